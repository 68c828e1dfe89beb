//! Third-party backends loaded from shared libraries at run time.
//!
//! A plugin is a `.so` (`.dylib`, `.dll`) exporting `kiln_plugin_entry`, which hands back
//! the function table of [`kiln_core::plugin_abi`]. [`load_plugin`] checks that table (ABI
//! major, size, every entry present), creates the backend, and validates what it says
//! about itself; the result is a [`PluginBackend`], an ordinary [`Backend`] that joins the
//! [`Registry`] beside the built-in ones and competes in automatic selection by score.
//! Loading it returns a [`PluginExecutor`], a [`LayerExecutor`] that calls through the
//! table and keeps the model's memory mapping alive for as long as the plugin may read it.
//!
//! The host also guards what comes back: it fills every logits buffer with NaN before
//! a plugin's `prefill`/`decode` and turns a value left non-finite into an
//! [`Error::Plugin`] naming the plugin and the call (output never changes silently because a
//! plugin wrote half a row).
//!
//! Failures never take the host down: a file that is not a library, a missing symbol, an
//! ABI of another major, a short table, a failing initialisation, malformed descriptions,
//! and panics inside the plugin (caught on its side by the SDK) all come back as
//! [`Error::Plugin`] naming the file and the cause. Libraries are never unloaded: Rust TLS
//! destructors and static initialisers in a plugin make `dlclose` unsound, so every library
//! opened stays mapped until the process exits.

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kiln_core::plugin_abi::*;
use kiln_core::{
    Architecture, Backend, DecodeItem, Error, LayerExecutor, LoadOptions, ModelConfig, ModelIr,
    ProgressFn, QType, Registry, Result, Sampler, SeqId, Support,
};

/// Environment variable listing extra plugin directories or library files (separated like
/// `PATH`).
pub const PLUGIN_PATH_ENV: &str = "KILN_PLUGIN_PATH";

/// The validated function table: every entry present.
struct Api {
    free_string: unsafe extern "C" fn(KilnOwnedStr),
    create_backend:
        unsafe extern "C" fn(u32, *mut *mut KilnBackend, *mut KilnOwnedStr) -> KilnStatus,
    destroy_backend: unsafe extern "C" fn(*mut KilnBackend),
    describe: unsafe extern "C" fn(
        *mut KilnBackend,
        *mut KilnBackendInfo,
        *mut KilnOwnedStr,
    ) -> KilnStatus,
    probe:
        unsafe extern "C" fn(*mut KilnBackend, *mut KilnOwnedStr, *mut KilnOwnedStr) -> KilnStatus,
    supports: unsafe extern "C" fn(
        *mut KilnBackend,
        *const KilnModelDesc,
        *mut KilnSupport,
        *mut KilnOwnedStr,
    ) -> KilnStatus,
    load: unsafe extern "C" fn(
        *mut KilnBackend,
        *const KilnModelDesc,
        *const KilnLoadOptions,
        *mut *mut KilnExecutor,
        *mut KilnExecutorInfo,
        *mut KilnOwnedStr,
    ) -> KilnStatus,
    free_executor: unsafe extern "C" fn(*mut KilnExecutor),
    new_sequence:
        unsafe extern "C" fn(*mut KilnExecutor, *mut u32, *mut KilnOwnedStr) -> KilnStatus,
    free_sequence: unsafe extern "C" fn(*mut KilnExecutor, u32, *mut KilnOwnedStr) -> KilnStatus,
    sequence_len:
        unsafe extern "C" fn(*mut KilnExecutor, u32, *mut u64, *mut KilnOwnedStr) -> KilnStatus,
    truncate_sequence:
        unsafe extern "C" fn(*mut KilnExecutor, u32, u64, *mut KilnOwnedStr) -> KilnStatus,
    prefill: unsafe extern "C" fn(
        *mut KilnExecutor,
        u32,
        *const u32,
        usize,
        *mut f32,
        usize,
        *mut KilnOwnedStr,
    ) -> KilnStatus,
    decode: unsafe extern "C" fn(
        *mut KilnExecutor,
        *const KilnDecodeItem,
        usize,
        *mut f32,
        usize,
        *mut KilnOwnedStr,
    ) -> KilnStatus,
    /// ABI 1.3; `None` for older plugins (the host then samples the logits of `decode`).
    decode_sample: Option<
        unsafe extern "C" fn(
            *mut KilnExecutor,
            *const KilnDecodeItem,
            usize,
            *mut KilnSamplerState,
            usize,
            *mut u32,
            usize,
            *mut KilnOwnedStr,
        ) -> KilnStatus,
    >,
}

impl Api {
    /// Copies the plugin's table (only the `struct_size` bytes it declares, so a shorter
    /// table from an older minor leaves later fields `None`) and checks every entry.
    ///
    /// # Safety
    /// `table` must point to at least `header.struct_size` readable bytes.
    unsafe fn read(
        table: *const KilnPluginApi,
        struct_size: u32,
    ) -> std::result::Result<Api, String> {
        // SAFETY: the table is a C struct of nullable function pointers (and integers), for
        // which all-zero bytes are a valid value (every entry `None`).
        let mut raw: KilnPluginApi = unsafe { std::mem::zeroed() };
        let n = (struct_size as usize).min(std::mem::size_of::<KilnPluginApi>());
        // SAFETY: the caller guarantees `struct_size` readable bytes at `table`; at most
        // `size_of::<KilnPluginApi>()` are written into `raw`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                table as *const u8,
                &mut raw as *mut KilnPluginApi as *mut u8,
                n,
            )
        };
        macro_rules! need {
            ($($f:ident),*) => {
                Api {
                    $($f: raw.$f.ok_or_else(|| format!("malformed function table: `{}` is null", stringify!($f)))?,)*
                    decode_sample: raw.decode_sample,
                }
            };
        }
        Ok(need!(
            free_string,
            create_backend,
            destroy_backend,
            describe,
            probe,
            supports,
            load,
            free_executor,
            new_sequence,
            free_sequence,
            sequence_len,
            truncate_sequence,
            prefill,
            decode
        ))
    }
}

/// One created plugin backend. Shared by the [`PluginBackend`] and every executor loaded
/// from it, so the backend is destroyed only after its last executor.
struct Plugin {
    path: PathBuf,
    abi_version: u32,
    api: Api,
    handle: *mut KilnBackend,
    name: String,
    version: String,
    /// What the plugin says about itself.
    own_description: String,
    /// `own_description` plus version and path, what listings show.
    listing: String,
    qtypes: Vec<QType>,
    architectures: Vec<Architecture>,
}

// SAFETY: the ABI requires a backend handle to accept `describe`/`probe`/`supports`/`load`
// from any thread concurrently (docs/plugins.md, "Threading"); the rest of `Plugin` is
// plain owned data.
unsafe impl Send for Plugin {}
// SAFETY: as for Send: concurrent calls on the backend handle are what the ABI requires.
unsafe impl Sync for Plugin {}

impl Drop for Plugin {
    fn drop(&mut self) {
        if !self.handle.is_null() {
            // SAFETY: the handle came from `create_backend` and every executor holding this
            // `Plugin` is gone.
            unsafe { (self.api.destroy_backend)(self.handle) }
        }
    }
}

fn plugin_error(path: &Path, message: impl Into<String>) -> Error {
    Error::Plugin {
        path: path.display().to_string(),
        message: message.into(),
    }
}

impl Plugin {
    fn error(&self, message: impl Into<String>) -> Error {
        plugin_error(&self.path, message)
    }

    /// Takes ownership of a plugin string: checks it, copies it, and hands it back to the
    /// plugin's allocator. A string that is too long or not UTF-8 is malformed data.
    fn take_string(&self, s: KilnOwnedStr, what: &str) -> Result<Option<String>> {
        if s.ptr.is_null() {
            return Ok(None);
        }
        let checked = if s.len > MAX_MESSAGE {
            Err(format!(
                "{what} is {} bytes long (at most {MAX_MESSAGE})",
                s.len
            ))
        } else {
            // SAFETY: the plugin handed out `len` bytes at `ptr`; they are ours until freed.
            let bytes = unsafe { std::slice::from_raw_parts(s.ptr, s.len) };
            std::str::from_utf8(bytes)
                .map(str::to_owned)
                .map_err(|e| format!("{what} is not UTF-8: {e}"))
        };
        // SAFETY: released exactly once, through the allocator that made it.
        unsafe { (self.api.free_string)(s) };
        checked
            .map(Some)
            .map_err(|m| self.error(format!("malformed data: {m}")))
    }

    /// Runs one table call with a fresh error slot and turns its status into a `Result`.
    fn call(&self, what: &str, f: impl FnOnce(*mut KilnOwnedStr) -> KilnStatus) -> Result<()> {
        let mut err = KilnOwnedStr::NONE;
        let status = f(&mut err);
        let message = self
            .take_string(err, &format!("{what} error message"))?
            .unwrap_or_default();
        self.status_result(what, status, message)
    }

    fn status_result(&self, what: &str, status: KilnStatus, message: String) -> Result<()> {
        let backend = || self.name.clone();
        match status {
            KilnStatus::OK => Ok(()),
            KilnStatus::INVALID_ARGUMENT => Err(Error::InvalidArgument(message)),
            KilnStatus::UNSUPPORTED => Err(Error::Unsupported(message)),
            KilnStatus::OUT_OF_MEMORY => Err(Error::OutOfMemory(message)),
            KilnStatus::INVALID_SHAPE => Err(Error::InvalidShape(message)),
            KilnStatus::FORMAT => Err(Error::Format(message)),
            KilnStatus::PANIC => Err(self.error(format!("panicked in {what}: {message}"))),
            KilnStatus::ERROR => Err(Error::Backend {
                backend: backend(),
                message,
            }),
            KilnStatus(other) => Err(Error::Backend {
                backend: backend(),
                message: format!("{what} failed with status {other}: {message}"),
            }),
        }
    }

    /// The boundary guard on a successful `prefill`/`decode`: the host filled `logits` with
    /// NaN before the call, so a value that is still not finite was left unwritten or
    /// written as NaN/inf. Either way the output is unusable, and saying so here names the
    /// plugin and the call instead of letting sampling silently change.
    fn check_logits(&self, what: &str, logits: &[f32], vocab: usize) -> Result<()> {
        let Some(first) = logits.iter().position(|v| !v.is_finite()) else {
            return Ok(());
        };
        let bad = logits.iter().filter(|v| !v.is_finite()).count();
        let row = match logits.len() > vocab {
            true => format!(", row {} column {}", first / vocab, first % vocab),
            false => String::new(),
        };
        Err(self.error(format!(
            "backend '{}' returned OK from {what} with {bad} of {} {UNWRITTEN_LOGITS} (first at index {first}{row}); \
             a backend must write every value, finite",
            self.name,
            logits.len()
        )))
    }

    /// Reads and checks what the backend says about itself.
    fn describe(&mut self) -> Result<()> {
        let mut info = KilnBackendInfo::empty();
        let handle = self.handle;
        let describe = self.api.describe;
        // SAFETY: valid handle, and an info struct whose size we declared.
        self.call("describe", |err| unsafe {
            describe(handle, &mut info, err)
        })
        .map_err(|e| self.error(format!("describe failed: {e}")))?;
        let malformed = |m: String| self.error(format!("malformed data from describe: {m}"));
        // SAFETY: the ABI keeps these valid until `destroy_backend`; lengths are checked
        // before anything is read.
        let (name, version, description) = unsafe {
            (
                info.name.to_str("name", MAX_NAME).map_err(malformed)?,
                info.version
                    .to_str("version", MAX_VERSION)
                    .map_err(malformed)?,
                info.description
                    .to_str("description", MAX_DESCRIPTION)
                    .map_err(malformed)?,
            )
        };
        if info.name.ptr.is_null() || name.is_empty() {
            return Err(malformed("the backend name is null or empty".into()));
        }
        if name.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(malformed(format!(
                "backend name {name:?} contains whitespace or control characters"
            )));
        }
        // SAFETY: as above.
        let ids = |ptr: *const u32, n: usize, what: &str| -> Result<Vec<u32>> {
            if n > MAX_LIST {
                return Err(malformed(format!("{n} {what} (at most {MAX_LIST})")));
            }
            if n == 0 {
                return Ok(Vec::new());
            }
            if ptr.is_null() {
                return Err(malformed(format!(
                    "{what} is a null pointer with length {n}"
                )));
            }
            // SAFETY: the plugin's `describe` promises `n` readable ids at `ptr` until
            // `destroy_backend` (checked non-null above); they are copied at once.
            Ok(unsafe { std::slice::from_raw_parts(ptr, n) }.to_vec())
        };
        let qtypes = ids(info.qtypes, info.n_qtypes, "qtypes")?
            .into_iter()
            .map(|id| QType::from_id(id).ok_or_else(|| malformed(format!("unknown qtype id {id}"))))
            .collect::<Result<Vec<_>>>()?;
        let architectures = ids(info.architectures, info.n_architectures, "architectures")?
            .into_iter()
            .map(|id| {
                arch_from_id(id).ok_or_else(|| malformed(format!("unknown architecture id {id}")))
            })
            .collect::<Result<Vec<_>>>()?;
        self.name = name.to_string();
        self.version = version.to_string();
        self.own_description = description.to_string();
        let runs = match architectures.is_empty() {
            true => "architectures: decided per model".to_string(),
            false => format!(
                "architectures: {}",
                architectures
                    .iter()
                    .map(|a| a.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        self.listing = format!(
            "{description} [plugin {version}, {}; {runs}]",
            self.path.display()
        );
        self.qtypes = qtypes;
        self.architectures = architectures;
        Ok(())
    }
}

/// Every library ever opened, kept until the process exits (see the module docs).
fn keep_forever(lib: libloading::Library) -> &'static libloading::Library {
    Box::leak(Box::new(lib))
}

/// A backend provided by a plugin library.
#[derive(Clone)]
pub struct PluginBackend {
    plugin: Arc<Plugin>,
}

impl std::fmt::Debug for PluginBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginBackend")
            .field("name", &self.plugin.name)
            .field("version", &self.plugin.version)
            .field("path", &self.plugin.path)
            .field("abi", &version_string(self.plugin.abi_version))
            .finish()
    }
}

impl PluginBackend {
    /// Opens the library at `path`, checks its function table and creates its backend.
    pub fn open(path: &Path) -> Result<PluginBackend> {
        // A FIFO or device would block the loader (or feed it anything): only regular files.
        match std::fs::metadata(path) {
            Ok(m) if m.is_file() => {}
            Ok(_) => return Err(plugin_error(path, "not a regular file".to_string())),
            Err(e) => return Err(plugin_error(path, format!("cannot read: {e}"))),
        }
        // SAFETY: loading a library runs its initialisers; that is what loading a plugin
        // means, and the user asked for this file.
        let lib = unsafe { libloading::Library::new(path) }
            .map_err(|e| plugin_error(path, format!("not a loadable shared library: {e}")))?;
        let lib = keep_forever(lib);
        // The symbol must be code before it is called: a data symbol of that name would be
        // jumped into (SIGSEGV, or worse).
        // SAFETY: reading a symbol's address calls nothing.
        let address = unsafe { lib.get::<*const std::ffi::c_void>(ENTRY_SYMBOL.as_bytes()) }
            .map(|sym| *sym as usize)
            .map_err(|e| plugin_error(path, format!("no entry symbol `{ENTRY_SYMBOL}`: {e}")))?;
        if let Some(false) = is_executable_address(address) {
            return Err(plugin_error(
                path,
                format!("`{ENTRY_SYMBOL}` is not a function (it lies outside the library's code)"),
            ));
        }
        // SAFETY: the symbol's type is fixed by the ABI, and it lies in executable memory.
        let entry = unsafe { lib.get::<KilnPluginEntry>(ENTRY_SYMBOL.as_bytes()) }
            .map_err(|e| plugin_error(path, format!("no entry symbol `{ENTRY_SYMBOL}`: {e}")))?;
        // SAFETY: the entry takes no arguments and returns a pointer to a static table.
        let table = unsafe { entry() };
        if table.is_null() {
            return Err(plugin_error(
                path,
                format!("`{ENTRY_SYMBOL}` returned a null function table"),
            ));
        }
        // SAFETY: every version of the table starts with this header.
        let header = unsafe { std::ptr::read(table as *const KilnPluginHeader) };
        if version_major(header.abi_version) != ABI_MAJOR {
            return Err(plugin_error(
                path,
                format!(
                    "plugin ABI version {} is incompatible with this kiln's ABI version {} (majors differ)",
                    version_string(header.abi_version),
                    version_string(ABI_VERSION)
                ),
            ));
        }
        if header.struct_size < API_SIZE_V1_0 {
            return Err(plugin_error(
                path,
                format!(
                    "function table is {} bytes; ABI {} needs at least {API_SIZE_V1_0}",
                    header.struct_size,
                    version_string(header.abi_version)
                ),
            ));
        }
        // SAFETY: the plugin declared `struct_size` readable bytes.
        let api =
            unsafe { Api::read(table, header.struct_size) }.map_err(|m| plugin_error(path, m))?;

        let mut handle: *mut KilnBackend = std::ptr::null_mut();
        let mut err = KilnOwnedStr::NONE;
        // SAFETY: out-pointers are valid for the call.
        let status = unsafe { (api.create_backend)(ABI_VERSION, &mut handle, &mut err) };
        let mut plugin = Plugin {
            path: path.to_path_buf(),
            abi_version: header.abi_version,
            api,
            handle,
            name: String::new(),
            version: String::new(),
            own_description: String::new(),
            listing: String::new(),
            qtypes: Vec::new(),
            architectures: Vec::new(),
        };
        let message = plugin
            .take_string(err, "create_backend error message")?
            .unwrap_or_default();
        if !status.is_ok() {
            let cause = plugin
                .status_result("create_backend", status, message)
                .unwrap_err();
            return Err(plugin.error(format!("initialisation failed: {}", bare_message(&cause))));
        }
        if plugin.handle.is_null() {
            return Err(plugin
                .error("malformed data: create_backend succeeded but returned a null backend"));
        }
        plugin.describe()?;
        Ok(PluginBackend {
            plugin: Arc::new(plugin),
        })
    }

    pub fn path(&self) -> &Path {
        &self.plugin.path
    }
    /// The plugin's own version string.
    pub fn version(&self) -> &str {
        &self.plugin.version
    }
    /// The ABI version the plugin was built against (`major << 16 | minor`).
    pub fn abi_version(&self) -> u32 {
        self.plugin.abi_version
    }
    /// Architectures the plugin declared; empty means it decides per model.
    pub fn architectures(&self) -> &[Architecture] {
        &self.plugin.architectures
    }
    /// The description the plugin gave, without the host's `[plugin version, path]` suffix.
    pub fn plugin_description(&self) -> &str {
        &self.plugin.own_description
    }

    /// Loads `model` as a concrete [`PluginExecutor`] (what [`Backend::load`] boxes).
    pub fn load_executor(&self, model: &ModelIr, options: &LoadOptions) -> Result<PluginExecutor> {
        // The descriptors first: a model the plugin's ABI cannot describe is refused
        // before anything else is asked of it.
        let desc = ModelDescBuf::new(model, self.plugin.abi_version)?;
        if let Some(kind) = options.kv_type {
            // The 1.x load options have no field for it: a plugin keeps the cache it has.
            return Err(Error::Unsupported(format!(
                "plugin {}: the plugin ABI carries no KV cache type, so --kv-type {kind} cannot be honoured (leave it out to use the plugin's own)",
                self.plugin.name
            )));
        }
        if options.tensor_parallel > 1 {
            return Err(Error::Unsupported(format!(
                "plugin {}: the plugin ABI has no way to split a model over ranks, so --tensor-parallel {} cannot be honoured",
                self.plugin.name, options.tensor_parallel
            )));
        }
        let p = &self.plugin;
        let mut progress: Option<ProgressFn> = options.progress.clone();
        let opts = KilnLoadOptions {
            struct_size: std::mem::size_of::<KilnLoadOptions>() as u32,
            _reserved: 0,
            max_context: options.max_context as u64,
            max_sequences: options.max_sequences as u64,
            threads: options.threads.unwrap_or(0) as u64,
            progress: progress
                .as_ref()
                .map(|_| progress_trampoline as KilnProgressFn),
            progress_user: progress.as_mut().map_or(std::ptr::null_mut(), |f| {
                f as *mut ProgressFn as *mut c_void
            }),
            // A 1.0 plugin reads only the prefix it knows and so never sees this: it loads
            // with exact activations, which the flag permits, never requires.
            flags: if options.quantized_activations {
                load_flags::QUANTIZED_ACTIVATIONS
            } else {
                0
            },
            _reserved1: 0,
        };
        let mut handle: *mut KilnExecutor = std::ptr::null_mut();
        let mut info = KilnExecutorInfo {
            struct_size: std::mem::size_of::<KilnExecutorInfo>() as u32,
            _reserved: 0,
            max_context: 0,
            max_sequences: 0,
        };
        let d = desc.desc();
        // SAFETY: every pointer is valid for the call; the tensor bytes live in `desc`,
        // which the executor keeps until it frees the plugin's executor.
        p.call("load", |err| unsafe {
            (p.api.load)(p.handle, &d, &opts, &mut handle, &mut info, err)
        })?;
        let mut exec = PluginExecutor {
            plugin: p.clone(),
            handle,
            model: desc,
            max_context: 0,
            max_sequences: 0,
            items: Vec::new(),
        };
        if handle.is_null() {
            exec.handle = std::ptr::null_mut();
            return Err(p.error("malformed data: load succeeded but returned a null executor"));
        }
        let limit = |v: u64, what: &str| {
            usize::try_from(v)
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| p.error(format!("malformed data: load reported {what} {v}")))
        };
        exec.max_context = limit(info.max_context, "max_context")?;
        exec.max_sequences = limit(info.max_sequences, "max_sequences")?;
        Ok(exec)
    }
}

/// The variant's message alone, for wrapping in another error.
fn bare_message(e: &Error) -> String {
    match e {
        Error::Backend { message, .. } | Error::Plugin { message, .. } => message.clone(),
        other => other.to_string(),
    }
}

unsafe extern "C" fn progress_trampoline(user: *mut c_void, done: u64, total: u64) {
    // SAFETY: `user` is the `ProgressFn` that `load_executor` keeps alive during `load`.
    let f = unsafe { &*(user as *const ProgressFn) };
    // The host's callback must not unwind into the plugin's frames.
    let _ = catch_unwind(AssertUnwindSafe(|| f(done, total)));
}

impl Backend for PluginBackend {
    fn name(&self) -> &str {
        &self.plugin.name
    }

    fn description(&self) -> &str {
        &self.plugin.listing
    }

    fn qtypes(&self) -> Vec<QType> {
        self.plugin.qtypes.clone()
    }

    fn probe(&self) -> Result<String, String> {
        let p = &self.plugin;
        let mut device = KilnOwnedStr::NONE;
        let mut err = KilnOwnedStr::NONE;
        // SAFETY: valid handle and out-pointers.
        let status = unsafe { (p.api.probe)(p.handle, &mut device, &mut err) };
        let device = p
            .take_string(device, "probe device")
            .map_err(|e| e.to_string())?;
        let message = p
            .take_string(err, "probe message")
            .map_err(|e| e.to_string())?
            .unwrap_or_default();
        match status {
            KilnStatus::OK => Ok(device.unwrap_or_default()),
            KilnStatus::UNAVAILABLE => Err(message),
            other => Err(p
                .status_result("probe", other, message)
                .unwrap_err()
                .to_string()),
        }
    }

    fn supports(&self, model: &ModelIr) -> Support {
        let p = &self.plugin;
        if !p.architectures.is_empty() && !p.architectures.contains(&model.config.arch) {
            let names: Vec<&str> = p.architectures.iter().map(|a| a.name()).collect();
            return Support::No {
                reason: format!(
                    "runs {}, not {}",
                    names.join(", "),
                    model.config.arch.name()
                ),
            };
        }
        let desc = match ModelDescBuf::new(model, p.abi_version) {
            Ok(desc) => desc,
            Err(e) => {
                return Support::No {
                    reason: e.to_string(),
                }
            }
        };
        let d = desc.desc();
        let mut out = KilnSupport {
            supported: 0,
            score: 0,
            message: KilnOwnedStr::NONE,
        };
        // SAFETY: descriptor and out-pointer valid for the call.
        let called = p.call("supports", |err| unsafe {
            (p.api.supports)(p.handle, &d, &mut out, err)
        });
        let message = p.take_string(
            std::mem::replace(&mut out.message, KilnOwnedStr::NONE),
            "supports message",
        );
        match (called, message) {
            (Err(e), _) | (Ok(()), Err(e)) => Support::No {
                reason: e.to_string(),
            },
            (Ok(()), Ok(m)) => match out.supported {
                1 => Support::Yes {
                    score: out.score,
                    note: m.unwrap_or_default(),
                },
                0 => Support::No {
                    reason: m.unwrap_or_default(),
                },
                other => Support::No {
                    reason: p
                        .error(format!(
                            "malformed data: supports answered {other} (0 or 1 expected)"
                        ))
                        .to_string(),
                },
            },
        }
    }

    fn load(&self, model: &ModelIr, options: &LoadOptions) -> Result<Box<dyn LayerExecutor>> {
        Ok(Box::new(self.load_executor(model, options)?))
    }
}

/// A model loaded by a plugin. Holds the model's descriptors and a clone of its IR (and so
/// the memory mapping the plugin reads weights from) until the plugin's executor is freed.
pub struct PluginExecutor {
    plugin: Arc<Plugin>,
    handle: *mut KilnExecutor,
    model: ModelDescBuf,
    max_context: usize,
    max_sequences: usize,
    /// Reused for every decode step.
    items: Vec<KilnDecodeItem>,
}

// SAFETY: the ABI allows an executor handle to move between threads as long as one thread
// uses it at a time, which `&mut self` (and the absence of `Sync`) guarantees.
unsafe impl Send for PluginExecutor {}

impl Drop for PluginExecutor {
    fn drop(&mut self) {
        if !self.handle.is_null() {
            // SAFETY: created by this plugin's `load`, released once; `self.model` (the
            // weights it reads) is dropped only after this.
            unsafe { (self.plugin.api.free_executor)(self.handle) }
        }
    }
}

impl PluginExecutor {
    pub fn backend_name(&self) -> &str {
        &self.plugin.name
    }
}

impl LayerExecutor for PluginExecutor {
    fn config(&self) -> &ModelConfig {
        &self.model.model().config
    }

    fn max_context(&self) -> usize {
        self.max_context
    }

    fn max_sequences(&self) -> usize {
        self.max_sequences
    }

    fn new_sequence(&mut self) -> Result<SeqId> {
        let p = &self.plugin;
        let mut seq = 0u32;
        // SAFETY: valid executor handle and out-pointer.
        p.call("new_sequence", |err| unsafe {
            (p.api.new_sequence)(self.handle, &mut seq, err)
        })?;
        Ok(seq)
    }

    fn free_sequence(&mut self, seq: SeqId) -> Result<()> {
        let p = &self.plugin;
        // SAFETY: valid executor handle.
        p.call("free_sequence", |err| unsafe {
            (p.api.free_sequence)(self.handle, seq, err)
        })
    }

    fn sequence_len(&self, seq: SeqId) -> Result<usize> {
        let p = &self.plugin;
        let mut len = 0u64;
        // SAFETY: valid executor handle and out-pointer; `&self` is enough because the
        // executor is not `Sync`, so no other call runs concurrently.
        p.call("sequence_len", |err| unsafe {
            (p.api.sequence_len)(self.handle, seq, &mut len, err)
        })?;
        usize::try_from(len)
            .ok()
            .filter(|&n| n <= self.max_context)
            .ok_or_else(|| {
                p.error(format!(
                    "malformed data: sequence {seq} reported length {len} beyond its context {}",
                    self.max_context
                ))
            })
    }

    fn truncate_sequence(&mut self, seq: SeqId, len: usize) -> Result<()> {
        let p = &self.plugin;
        // SAFETY: valid executor handle.
        p.call("truncate_sequence", |err| unsafe {
            (p.api.truncate_sequence)(self.handle, seq, len as u64, err)
        })
    }

    fn prefill(&mut self, seq: SeqId, tokens: &[u32], logits: &mut [f32]) -> Result<()> {
        let vocab = self.config().vocab_size;
        if logits.len() != vocab {
            return Err(Error::InvalidArgument(format!(
                "logits buffer holds {}; vocab is {vocab}",
                logits.len()
            )));
        }
        let p = &self.plugin;
        logits.fill(f32::NAN);
        // SAFETY: the slices are valid for their lengths during the call.
        p.call("prefill", |err| unsafe {
            (p.api.prefill)(
                self.handle,
                seq,
                tokens.as_ptr(),
                tokens.len(),
                logits.as_mut_ptr(),
                logits.len(),
                err,
            )
        })?;
        p.check_logits("prefill", logits, vocab)
    }

    fn decode(&mut self, batch: &[DecodeItem], logits: &mut [f32]) -> Result<()> {
        let vocab = self.model.model().config.vocab_size;
        if logits.len() != batch.len() * vocab {
            return Err(Error::InvalidArgument(format!(
                "logits buffer holds {} values; a batch of {} needs {}",
                logits.len(),
                batch.len(),
                batch.len() * vocab
            )));
        }
        self.items.clear();
        self.items.extend(batch.iter().map(|i| KilnDecodeItem {
            seq: i.seq,
            token: i.token,
        }));
        let p = &self.plugin;
        let (handle, items) = (self.handle, &self.items);
        logits.fill(f32::NAN);
        // SAFETY: the slices are valid for their lengths during the call.
        p.call("decode", |err| unsafe {
            (p.api.decode)(
                handle,
                items.as_ptr(),
                items.len(),
                logits.as_mut_ptr(),
                logits.len(),
                err,
            )
        })?;
        p.check_logits("decode", logits, vocab)
    }

    fn decode_sample(
        &mut self,
        batch: &[DecodeItem],
        samplers: &mut [Sampler],
        tokens: &mut [u32],
    ) -> Result<()> {
        let sample_here = samplers.iter().any(|s| !s.params.logit_bias.is_empty());
        let Some(decode_sample) = self.plugin.api.decode_sample.filter(|_| !sample_here) else {
            // A plugin before ABI 1.3, or a logit bias (the ABI does not carry one): the
            // plugin's logits, sampled here.
            return kiln_core::decode_sample_on_host(self, batch, samplers, tokens);
        };
        kiln_core::check_sample_slots(batch.len(), samplers.len(), tokens.len())?;
        let vocab = self.model.model().config.vocab_size;
        self.items.clear();
        self.items.extend(batch.iter().map(|i| KilnDecodeItem {
            seq: i.seq,
            token: i.token,
        }));
        let recents: Vec<Vec<u32>> = samplers.iter().map(|s| s.recent().collect()).collect();
        let mut states: Vec<KilnSamplerState> = samplers
            .iter()
            .zip(&recents)
            .map(|(s, r)| KilnSamplerState::from_sampler(s, r))
            .collect();
        // Poisoned: an id the plugin leaves unwritten is outside every vocabulary.
        tokens.fill(u32::MAX);
        let p = &self.plugin;
        let (handle, items) = (self.handle, &self.items);
        // SAFETY: every slice is valid for its length during the call; `recents` outlives it.
        p.call("decode_sample", |err| unsafe {
            decode_sample(
                handle,
                items.as_ptr(),
                items.len(),
                states.as_mut_ptr(),
                states.len(),
                tokens.as_mut_ptr(),
                tokens.len(),
                err,
            )
        })?;
        if let Some(t) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(plugin_error(
                &p.path,
                format!("decode_sample returned token {t}, outside the vocabulary of {vocab} (unwritten or invalid)"),
            ));
        }
        for ((sampler, state), &token) in samplers.iter_mut().zip(&states).zip(tokens.iter()) {
            sampler.rng = kiln_core::Rng::new(state.rng_state);
            sampler.accept(token);
        }
        Ok(())
    }
}

/// Loads one plugin library as a backend.
/// Whether `address` lies in an executable mapping of this process (`/proc/self/maps`);
/// `None` where that cannot be read (other systems): the check is then skipped.
fn is_executable_address(address: usize) -> Option<bool> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    for line in maps.lines() {
        let mut fields = line.split_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else {
            continue;
        };
        let Some((lo, hi)) = range.split_once('-') else {
            continue;
        };
        let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
        else {
            continue;
        };
        if (lo..hi).contains(&address) {
            return Some(perms.as_bytes().get(2) == Some(&b'x'));
        }
    }
    Some(false)
}

pub fn load_plugin(path: &Path) -> Result<Arc<dyn Backend>> {
    Ok(Arc::new(PluginBackend::open(path)?))
}

/// Where plugins are searched besides explicit paths: each entry of `KILN_PLUGIN_PATH` (a
/// directory, whose libraries are all loaded, or a library file), then `plugins/` beside
/// the running executable.
pub fn plugin_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os(PLUGIN_PATH_ENV)
        .map(|v| {
            std::env::split_paths(&v)
                .filter(|p| !p.as_os_str().is_empty())
                .collect()
        })
        .unwrap_or_default();
    if let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|d| d.join("plugins")))
    {
        dirs.push(dir);
    }
    dirs
}

/// Shared libraries directly inside `dir`, sorted by file name.
fn libraries_in(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.is_file()
                && p.extension()
                    .is_some_and(|e| e == std::env::consts::DLL_EXTENSION)
        })
        .collect();
    found.sort();
    Ok(found)
}

/// Loads every plugin from `explicit` paths (files, or directories to scan), then from the
/// [`plugin_dirs`]. Returns the backends that loaded and, separately, every refusal; a bad
/// plugin never stops the others. A library reached twice is loaded once, and a second
/// plugin claiming an already-taken name is refused.
pub fn discover_plugins(explicit: &[PathBuf]) -> (Vec<Arc<dyn Backend>>, Vec<Error>) {
    let (found, errors) = discover(explicit);
    (
        found
            .into_iter()
            .map(|b| Arc::new(b) as Arc<dyn Backend>)
            .collect(),
        errors,
    )
}

fn discover(explicit: &[PathBuf]) -> (Vec<PluginBackend>, Vec<Error>) {
    let mut candidates: Vec<PathBuf> = Vec::new();
    let mut errors: Vec<Error> = Vec::new();
    for path in explicit {
        if path.is_dir() {
            match libraries_in(path) {
                Ok(found) => candidates.extend(found),
                Err(e) => errors.push(plugin_error(
                    path,
                    format!("cannot read plugin directory: {e}"),
                )),
            }
        } else if path.exists() {
            candidates.push(path.clone());
        } else {
            errors.push(plugin_error(path, "no such file"));
        }
    }
    // Search entries that do not exist are normal (an unset-up `plugins/`), not errors. A
    // file is loaded whatever its extension: naming it is asking for it.
    for entry in plugin_dirs() {
        if entry.is_file() {
            candidates.push(entry);
        } else if entry.is_dir() {
            match libraries_in(&entry) {
                Ok(found) => candidates.extend(found),
                Err(e) => errors.push(plugin_error(
                    &entry,
                    format!("cannot read plugin directory: {e}"),
                )),
            }
        }
    }

    let mut seen: Vec<PathBuf> = Vec::new();
    let mut backends: Vec<PluginBackend> = Vec::new();
    for path in candidates {
        let canonical = path.canonicalize().unwrap_or_else(|_| path.clone());
        if seen.contains(&canonical) {
            continue;
        }
        seen.push(canonical);
        match PluginBackend::open(&path) {
            Ok(b) if backends.iter().any(|o| o.name() == b.name()) => errors.push(plugin_error(
                &path,
                format!(
                    "another plugin already provides a backend named '{}'",
                    b.name()
                ),
            )),
            Ok(b) => backends.push(b),
            Err(e) => errors.push(e),
        }
    }
    (backends, errors)
}

/// [`discover_plugins`], then registers each backend; a plugin whose name a backend in
/// `registry` already has (a built-in `cpu`, say) is refused. Returns every refusal.
pub fn register_plugins(registry: &mut Registry, explicit: &[PathBuf]) -> Vec<Error> {
    let (backends, mut errors) = discover(explicit);
    for b in backends {
        let path = b.path().to_path_buf();
        if let Err(e) = registry.register(Arc::new(b)) {
            errors.push(plugin_error(&path, bare_message(&e)));
        }
    }
    errors
}
