//! A CUDA device: its context and loaded kernel modules (shared), a stream per executor,
//! events and CUDA graphs.

use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::{Arc, Mutex};

use cudarc::driver::{result, sys};

use crate::compile::{self, KernelModule};
use crate::error::{DriverContext, KernelError, Result};
use crate::libs;

/// A kernel entry point, resolved once.
#[derive(Debug, Clone, Copy)]
pub struct Function(sys::CUfunction);

// SAFETY: CUfunction handles are plain driver handles, valid in any thread once the context
// is current (every Device method makes it so).
unsafe impl Send for Function {}
// SAFETY: as for Send; shared use goes through the same thread-safe driver calls.
unsafe impl Sync for Function {}

/// Kernel arguments, copied into fixed slots so their addresses stay valid for the launch.
/// Every kiln kernel parameter is a device pointer, an `int` or a `float`.
#[derive(Debug, Clone, Default)]
pub struct Args {
    slots: [u64; Args::CAPACITY],
    n: usize,
}

impl Args {
    /// The most parameters a kernel may take (the longest list, the GEMVs', has 27: a test
    /// holds every kernel in `cuda/` to this).
    pub const CAPACITY: usize = 32;

    pub fn new() -> Self {
        Self::default()
    }
    fn push_bits(mut self, bits: u64) -> Self {
        assert!(
            self.n < Self::CAPACITY,
            "more than {} kernel arguments",
            Self::CAPACITY
        );
        self.slots[self.n] = bits;
        self.n += 1;
        self
    }
    /// A device pointer (0 is the null pointer kernels treat as "absent").
    pub fn ptr(self, p: u64) -> Self {
        self.push_bits(p)
    }
    pub fn i32(self, v: i32) -> Self {
        self.push_bits(v as u32 as u64)
    }
    pub fn f32(self, v: f32) -> Self {
        self.push_bits(v.to_bits() as u64)
    }
    pub fn u64(self, v: u64) -> Self {
        self.push_bits(v)
    }
    /// The arguments pushed so far, as the kernel receives them (ints and floats in the
    /// low 32 bits).
    pub fn slots(&self) -> &[u64] {
        &self.slots[..self.n]
    }
}

/// Launch geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchConfig {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_bytes: u32,
}

impl LaunchConfig {
    pub fn linear(blocks: u32, threads: u32) -> Self {
        LaunchConfig {
            grid: (blocks, 1, 1),
            block: (threads, 1, 1),
            shared_bytes: 0,
        }
    }
}

/// What every stream of one GPU shares: the primary context, the device's properties, and
/// the loaded kernel modules (compiled and loaded once per process, whoever asks first).
struct Context {
    ordinal: usize,
    cu_device: sys::CUdevice,
    ctx: sys::CUcontext,
    name: String,
    arch: (i32, i32),
    driver_version: i32,
    sm_count: i32,
    /// Shared memory a block may use when its kernel opts in (227 KiB on the H200).
    shared_optin: i32,
    total_mem: usize,
    modules: Mutex<HashMap<&'static str, sys::CUmodule>>,
    functions: Mutex<HashMap<String, Function>>,
}

// SAFETY: the driver's handles are thread-safe; the tables are behind mutexes; every user
// binds the context before a driver call.
unsafe impl Send for Context {}
// SAFETY: as for Send; shared use goes through the same thread-safe driver calls.
unsafe impl Sync for Context {}

impl Drop for Context {
    fn drop(&mut self) {
        // Teardown errors cannot be acted on; the context goes away with the process.
        // SAFETY: the context was retained by `Device::new` and is released once, here.
        unsafe {
            let _ = result::ctx::set_current(self.ctx);
            for (_, m) in self
                .modules
                .lock()
                .map(|mut m| std::mem::take(&mut *m))
                .unwrap_or_default()
            {
                let _ = result::module::unload(m);
            }
            let _ = result::primary_ctx::release(self.cu_device);
        }
    }
}

/// One GPU as one executor sees it: the shared [`Context`] and a non-blocking stream of its
/// own. Everything queued through a `Device` (launches, copies, graph captures) goes to its
/// stream, so two executors on two `Device`s of one GPU run side by side and a graph
/// captured on one records none of the other's work. [`Device::new_stream`] makes another.
pub struct Device {
    context: Arc<Context>,
    stream: sys::CUstream,
}

// SAFETY: the driver's handles are thread-safe; each method binds the context first.
unsafe impl Send for Device {}
// SAFETY: as for Send; shared use goes through the same thread-safe driver calls.
unsafe impl Sync for Device {}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Device({} {}: {} sm_{}{})",
            self.context.ordinal,
            self.context.name,
            self.context.sm_count,
            self.context.arch.0,
            self.context.arch.1
        )
    }
}

/// `Ok(count)` of CUDA devices, or why CUDA cannot be used here. Never panics.
pub fn device_count() -> Result<usize> {
    libs::driver_status().map_err(KernelError::NoDriver)?;
    result::init().map_err(|e| KernelError::NoDriver(format!("cuInit failed: {e}")))?;
    let n = result::device::get_count().ctx("cuDeviceGetCount")?;
    Ok(n.max(0) as usize)
}

impl Device {
    /// Opens device `ordinal`. Fails (never panics) when there is no driver or device.
    pub fn new(ordinal: usize) -> Result<Arc<Device>> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(KernelError::NoDriver(format!(
                "CUDA device {ordinal} requested, {count} present"
            )));
        }
        let cu_device = result::device::get(ordinal as i32).ctx("cuDeviceGet")?;
        // SAFETY: valid device handle from above.
        let ctx =
            unsafe { result::primary_ctx::retain(cu_device) }.ctx("cuDevicePrimaryCtxRetain")?;
        // SAFETY: `ctx` was just retained for this valid device.
        unsafe { result::ctx::set_current(ctx) }.ctx("cuCtxSetCurrent")?;
        // SAFETY: a valid device handle and attribute enum (closure used only below).
        let attr = |a| unsafe { result::device::get_attribute(cu_device, a) };
        use sys::CUdevice_attribute::*;
        let arch = (
            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR).ctx("cuDeviceGetAttribute")?,
            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR).ctx("cuDeviceGetAttribute")?,
        );
        let sm_count =
            attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).ctx("cuDeviceGetAttribute")?;
        let shared_optin = attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .ctx("cuDeviceGetAttribute")?;
        let name = result::device::get_name(cu_device).ctx("cuDeviceGetName")?;
        // SAFETY: a valid device handle.
        let total_mem = unsafe { result::device::total_mem(cu_device) }.ctx("cuDeviceTotalMem")?;
        let mut driver_version = 0;
        // SAFETY: writes one int.
        unsafe { sys::cuDriverGetVersion(&mut driver_version) }
            .result()
            .ctx("cuDriverGetVersion")?;
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
            .ctx("cuStreamCreate")?;
        let context = Arc::new(Context {
            ordinal,
            cu_device,
            ctx,
            name,
            arch,
            driver_version,
            sm_count,
            shared_optin,
            total_mem,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
        });
        Ok(Arc::new(Device { context, stream }))
    }

    /// Another handle on the same GPU with a stream of its own (same context, same loaded
    /// kernels): what each executor takes, so its work and its graph captures stay apart
    /// from every other executor's.
    pub fn new_stream(&self) -> Result<Arc<Device>> {
        self.bind()?;
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
            .ctx("cuStreamCreate")?;
        Ok(Arc::new(Device {
            context: self.context.clone(),
            stream,
        }))
    }

    pub fn name(&self) -> &str {
        &self.context.name
    }
    /// Compute capability, e.g. (9, 0).
    pub fn arch(&self) -> (i32, i32) {
        self.context.arch
    }
    pub fn sm_count(&self) -> usize {
        self.context.sm_count as usize
    }
    /// Bytes of shared memory one block may take when its kernel was loaded by
    /// [`Device::function_with_shared`].
    pub fn shared_per_block_optin(&self) -> usize {
        self.context.shared_optin.max(0) as usize
    }
    pub fn total_memory(&self) -> usize {
        self.context.total_mem
    }
    /// As `cuDriverGetVersion`: 13000 for CUDA 13.0.
    pub fn driver_version(&self) -> i32 {
        self.context.driver_version
    }
    pub fn stream(&self) -> sys::CUstream {
        self.stream
    }

    /// Makes this device's context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        // SAFETY: the context is retained for the life of `self`.
        unsafe { result::ctx::set_current(self.context.ctx) }.ctx("cuCtxSetCurrent")
    }

    /// (free, total) device memory in bytes.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        result::mem_get_info().ctx("cuMemGetInfo")
    }

    /// Compiles (or takes from the cache) and loads every module of `modules` not loaded
    /// yet, compiling the missing ones in parallel ([`compile::compile_many`]); idempotent.
    pub fn load_modules(&self, modules: &[KernelModule]) -> Result<()> {
        let mut table = self.context.modules.lock().expect("module table poisoned");
        let mut wanted: Vec<KernelModule> = modules
            .iter()
            .filter(|m| !table.contains_key(m.name))
            .copied()
            .collect();
        wanted.sort_by_key(|m| m.name);
        wanted.dedup_by_key(|m| m.name);
        if wanted.is_empty() {
            return Ok(());
        }
        let cubins = compile::compile_many(&wanted, self.arch(), self.driver_version())?;
        self.bind()?;
        for (m, cubin) in wanted.iter().zip(cubins) {
            // SAFETY: `cubin` is an ELF image NVRTC produced for this architecture.
            let loaded = unsafe { result::module::load_data(cubin.as_ptr() as *const c_void) }
                .ctx("cuModuleLoadData")?;
            table.insert(m.name, loaded);
        }
        Ok(())
    }

    /// Compiles (or takes from the cache) and loads `module`; idempotent.
    pub fn load_module(&self, module: &KernelModule) -> Result<sys::CUmodule> {
        let mut modules = self.context.modules.lock().expect("module table poisoned");
        if let Some(&m) = modules.get(module.name) {
            return Ok(m);
        }
        let cubin = compile::compile(module, self.arch(), self.driver_version())?;
        self.bind()?;
        // SAFETY: `cubin` is an ELF image NVRTC produced for this architecture.
        let m = unsafe { result::module::load_data(cubin.as_ptr() as *const c_void) }
            .ctx("cuModuleLoadData")?;
        modules.insert(module.name, m);
        Ok(m)
    }

    /// The function cached under `key`, or the one `load` gives, cached from then on.
    fn cached_function(
        &self,
        key: String,
        load: impl FnOnce(&str) -> Result<Function>,
    ) -> Result<Function> {
        let functions = || {
            self.context
                .functions
                .lock()
                .expect("function table poisoned")
        };
        if let Some(&f) = functions().get(&key) {
            return Ok(f);
        }
        let f = load(&key)?;
        functions().insert(key, f);
        Ok(f)
    }

    /// The kernel `name` of `module`.
    pub fn function(&self, module: &KernelModule, name: &str) -> Result<Function> {
        self.cached_function(format!("{}::{name}", module.name), |key| {
            let m = self.load_module(module)?;
            let cname = CString::new(name)
                .map_err(|_| KernelError::InvalidArgument(format!("kernel name {name:?}")))?;
            // SAFETY: `m` is a loaded module.
            let f = unsafe { result::module::get_function(m, cname) }
                .ctx(&format!("cuModuleGetFunction({key})"))?;
            Ok(Function(f))
        })
    }

    /// [`Device::function`] for a kernel that takes more than 48 KiB of dynamic shared
    /// memory: the limit is raised once, when the kernel is first loaded, to what the
    /// device allows a block ([`Device::shared_per_block_optin`]).
    pub fn function_with_shared(&self, module: &KernelModule, name: &str) -> Result<Function> {
        self.cached_function(format!("{}::{name}+shared", module.name), |key| {
            let f = self.function(module, name)?;
            self.bind()?;
            // A block's static and dynamic shared memory together may not pass the opt-in
            // limit, so the dynamic limit is what the kernel's static arrays leave.
            let mut static_bytes: std::os::raw::c_int = 0;
            // SAFETY: `f` is a loaded function; the attribute is written to `static_bytes`.
            unsafe {
                sys::cuFuncGetAttribute(
                    &mut static_bytes,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                    f.0,
                )
            }
            .result()
            .ctx(&format!("cuFuncGetAttribute({key})"))?;
            // SAFETY: `f` is a loaded function; the attribute takes a byte count.
            unsafe {
                sys::cuFuncSetAttribute(
                    f.0,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    self.context.shared_optin - static_bytes,
                )
            }
            .result()
            .ctx(&format!("cuFuncSetAttribute({key})"))?;
            Ok(f)
        })
    }

    /// Launches `f` on the device's stream.
    ///
    /// On sm_90 and newer every launch allows programmatic dependent launch: the kernel may
    /// be scheduled before its predecessor on the stream finishes, and waits for it inside
    /// (`grid_dependency_wait()`, the first statement of every kiln kernel). Inside a CUDA
    /// graph this hides most of the launch gap between the many small kernels of a decode
    /// step.
    ///
    /// # Safety
    /// `args` must match the kernel's parameter list, and every pointer in it must address
    /// live device memory large enough for what the kernel touches with this geometry.
    pub unsafe fn launch(&self, f: Function, cfg: LaunchConfig, args: &mut Args) -> Result<()> {
        // SAFETY: an all-zero attribute is a valid "ignore" entry; the id and value are set next.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let attrs = if self.arch().0 >= 9 {
            std::slice::from_mut(&mut attr)
        } else {
            &mut []
        };
        // SAFETY: this fn's contract is `launch_with`'s.
        unsafe { self.launch_with(f, cfg, args, attrs, "cuLaunchKernelEx") }
    }

    /// `cuLaunchKernelEx` of `f` on the stream with launch attributes `attrs`.
    ///
    /// # Safety
    /// As for [`Device::launch`].
    unsafe fn launch_with(
        &self,
        f: Function,
        cfg: LaunchConfig,
        args: &mut Args,
        attrs: &mut [sys::CUlaunchAttribute],
        what: &str,
    ) -> Result<()> {
        let mut params: [*mut c_void; Args::CAPACITY] = [std::ptr::null_mut(); Args::CAPACITY];
        for (p, slot) in params.iter_mut().zip(args.slots.iter_mut()).take(args.n) {
            *p = slot as *mut u64 as *mut c_void;
        }
        self.bind()?;
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid.0,
            gridDimY: cfg.grid.1,
            gridDimZ: cfg.grid.2,
            blockDimX: cfg.block.0,
            blockDimY: cfg.block.1,
            blockDimZ: cfg.block.2,
            sharedMemBytes: cfg.shared_bytes,
            hStream: self.stream,
            attrs: if attrs.is_empty() {
                std::ptr::null_mut()
            } else {
                attrs.as_mut_ptr()
            },
            numAttrs: attrs.len() as u32,
        };
        // SAFETY: the context is bound; `params` points at `args`' slots and `attrs` at the
        // caller's attributes, both live until the call returns; the caller promises the
        // arguments match the kernel (this fn's contract).
        unsafe { sys::cuLaunchKernelEx(&config, f.0, params.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .ctx(what)
    }

    /// Blocks of `threads` threads of `f` that can be resident on one SM at once.
    pub fn max_active_blocks(&self, f: Function, threads: u32) -> Result<usize> {
        self.bind()?;
        let mut n: std::ffi::c_int = 0;
        // SAFETY: the context is bound and `f` is a loaded function of it.
        unsafe { sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut n, f.0, threads as _, 0) }
            .result()
            .ctx("cuOccupancyMaxActiveBlocksPerMultiprocessor")?;
        Ok(n.max(0) as usize)
    }

    /// Launches `f` as a cooperative grid of `blocks` × `threads`: the driver guarantees
    /// every block is resident at once (or refuses the launch), which a kernel that waits
    /// at grid-wide barriers needs.
    ///
    /// # Safety
    /// As for [`Device::launch`].
    pub unsafe fn launch_cooperative(
        &self,
        f: Function,
        blocks: u32,
        threads: u32,
        args: &mut Args,
    ) -> Result<()> {
        // SAFETY: an all-zero attribute is a valid "ignore" entry; the id and value are set next.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
        attr.value.cooperative = 1;
        let cfg = LaunchConfig::linear(blocks, threads);
        // SAFETY: this fn's contract is `launch_with`'s.
        unsafe {
            self.launch_with(
                f,
                cfg,
                args,
                std::slice::from_mut(&mut attr),
                "cuLaunchKernelEx (cooperative)",
            )
        }
    }

    /// Waits for everything queued on the stream; surfaces asynchronous kernel faults.
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: the stream lives as long as `self`.
        unsafe { result::stream::synchronize(self.stream) }.ctx("cuStreamSynchronize")
    }

    /// Runs `body` inside a profiler range: with `ncu --profile-from-start off` only the
    /// kernels launched in it are profiled (so a benchmark can skip its setup and warm-up).
    /// Outside a profiler the range costs two driver calls and changes nothing.
    pub fn profiler_range<R>(&self, body: impl FnOnce() -> R) -> Result<R> {
        self.synchronize()?;
        // SAFETY: no arguments; the context is current (bound by `synchronize`).
        unsafe { sys::cuProfilerStart() }
            .result()
            .ctx("cuProfilerStart")?;
        let out = body();
        self.synchronize()?;
        // SAFETY: as above.
        unsafe { sys::cuProfilerStop() }
            .result()
            .ctx("cuProfilerStop")?;
        Ok(out)
    }

    /// Records everything `body` queues on the stream into a CUDA graph, instantiated and
    /// ready to replay. `body` must only queue work (launches, async copies), not wait.
    pub fn capture(self: &Arc<Self>, body: impl FnOnce() -> Result<()>) -> Result<Graph> {
        self.bind()?;
        // SAFETY: valid stream; capture mode "relaxed" lets other threads use the driver.
        unsafe {
            result::stream::begin_capture(
                self.stream,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
            )
        }
        .ctx("cuStreamBeginCapture")?;
        let queued = body();
        // End the capture on every path, or the stream stays unusable.
        // SAFETY: this stream began capturing above; ending it on every path keeps it usable.
        let graph = unsafe { result::stream::end_capture(self.stream) };
        queued?;
        let graph = graph.ctx("cuStreamEndCapture")?;
        // SAFETY: `graph` is the graph the capture returned.
        let exec = unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) };
        let exec = match exec {
            Ok(e) => e,
            Err(e) => {
                // SAFETY: the graph failed to instantiate and is not used again.
                let _ = unsafe { result::graph::destroy(graph) };
                return Err(KernelError::Driver {
                    what: "cuGraphInstantiate".into(),
                    source: e,
                });
            }
        };
        Ok(Graph {
            device: self.clone(),
            graph,
            exec,
        })
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // Teardown errors cannot be acted on. The context (and its modules) goes when the
        // last stream's handle does.
        let _ = self.bind();
        // SAFETY: the stream (and its modules) belong to this handle and are destroyed once.
        unsafe {
            let _ = result::stream::synchronize(self.stream);
            let _ = result::stream::destroy(self.stream);
        }
    }
}

/// An instantiated CUDA graph: a captured sequence of launches replayed with one call.
pub struct Graph {
    device: Arc<Device>,
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
}

// SAFETY: graph handles are driver objects usable from any thread with the context bound.
unsafe impl Send for Graph {}

impl Graph {
    /// Queues one replay on the device's stream.
    pub fn launch(&self) -> Result<()> {
        self.device.bind()?;
        // SAFETY: exec and stream are live.
        unsafe { result::graph::launch(self.exec, self.device.stream) }.ctx("cuGraphLaunch")
    }

    /// How many operations (kernels, copies, memsets) the graph holds.
    pub fn node_count(&self) -> Result<usize> {
        let mut n = 0usize;
        // SAFETY: a null node array asks only for the count.
        unsafe { sys::cuGraphGetNodes(self.graph, std::ptr::null_mut(), &mut n) }
            .result()
            .ctx("cuGraphGetNodes")?;
        Ok(n)
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        let _ = self.device.bind();
        // SAFETY: this handle owns the executable graph; destroyed once.
        unsafe {
            let _ = result::graph::exec_destroy(self.exec);
            let _ = result::graph::destroy(self.graph);
        }
    }
}

/// A timing event on the device's stream.
pub struct Event {
    device: Arc<Device>,
    event: sys::CUevent,
}

impl Event {
    pub fn new(device: &Arc<Device>) -> Result<Event> {
        device.bind()?;
        let event =
            result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).ctx("cuEventCreate")?;
        Ok(Event {
            device: device.clone(),
            event,
        })
    }
    pub fn record(&self) -> Result<()> {
        self.device.bind()?;
        // SAFETY: the event and the stream belong to this device.
        unsafe { result::event::record(self.event, self.device.stream) }.ctx("cuEventRecord")
    }
    /// Milliseconds from `self` to `end`; waits for `end`.
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        self.device.bind()?;
        // SAFETY: both events were created on this device; `ms` is written by the driver.
        unsafe {
            result::event::synchronize(end.event).ctx("cuEventSynchronize")?;
            result::event::elapsed(self.event, end.event).ctx("cuEventElapsedTime")
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let _ = self.device.bind();
        // SAFETY: this handle owns the event; destroyed once.
        let _ = unsafe { result::event::destroy(self.event) };
    }
}
