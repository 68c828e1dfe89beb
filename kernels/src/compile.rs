//! Run-time compilation of kiln's CUDA C sources with NVRTC, and the on-disk cache of the
//! results.
//!
//! Each [`KernelModule`] is `cuda/common.cuh` followed by one `.cu` file, embedded in the
//! binary. It is compiled to a cubin for one exact architecture (`sm_90` on an H200), so
//! the driver never JIT-compiles PTX and Hopper-only instructions are available. Cubins are
//! cached under `$KILN_KERNEL_CACHE` or `~/.cache/kiln/kernels`, named by a hash of the
//! source, the architecture, the compile options and the NVRTC and driver versions; a stale
//! or corrupt entry can only miss, never be loaded for the wrong inputs.

use std::ffi::{c_char, CString};
use std::path::PathBuf;

use sha2::{Digest, Sha256};

use crate::error::{KernelError, Result};
use crate::kv::KvFormat;
use crate::libs;

const COMMON: &str = include_str!("../cuda/common.cuh");

/// One compilation unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KernelModule {
    pub name: &'static str,
    source: &'static str,
    /// Appended to `source`: the instantiation lines of a per-type module.
    suffix: &'static str,
}

impl KernelModule {
    /// A module from arbitrary text (tests of the compile path itself).
    #[doc(hidden)]
    pub fn for_test(name: &'static str, source: &'static str) -> Self {
        KernelModule {
            name,
            source,
            suffix: "",
        }
    }

    /// The full text NVRTC compiles.
    pub fn source(&self) -> String {
        format!(
            "#line 1 \"common.cuh\"\n{COMMON}\n#line 1 \"{}.cu\"\n{}\n{}\n",
            self.name, self.source, self.suffix
        )
    }
}

const fn module(name: &'static str, source: &'static str) -> KernelModule {
    KernelModule {
        name,
        source,
        suffix: "",
    }
}

pub const NORM: KernelModule = module("norm", include_str!("../cuda/norm.cu"));
pub const ROPE: KernelModule = module("rope", include_str!("../cuda/rope.cu"));
/// A Mixture of Experts' routing and the join of its experts' outputs (the expert GEMVs
/// are the formats' own).
pub const MOE: KernelModule = module("moe", include_str!("../cuda/moe.cu"));
const ATTENTION_SRC: &str = include_str!("../cuda/attention.cu");

/// Decode attention, one module per head size (32·E for E = 1..=8) and KV cache format: a
/// model compiles the one it needs.
macro_rules! attention_modules {
    ($prefix:literal, $entry:literal, $batch:literal: $($e:literal)*) => {
        [$(KernelModule {
            name: concat!($prefix, $e),
            source: ATTENTION_SRC,
            suffix: concat!($entry, "(", $e, ")\n", $batch, "(", $e, ")"),
        }),*]
    };
}
pub static ATTENTION: [KernelModule; 8] =
    attention_modules!("attention_", "ATTN_ENTRY", "ATTN_BATCH_ENTRY": 1 2 3 4 5 6 7 8);
/// The same over a q8_0 cache.
pub static ATTENTION_Q8: [KernelModule; 8] =
    attention_modules!("attention_q8_", "ATTN_Q8_ENTRY", "ATTN_Q8_BATCH_ENTRY": 1 2 3 4 5 6 7 8);

/// The attention module for heads of `head_dim` values (a multiple of 32 up to 256) over a
/// cache in `kv`.
pub fn attention_module(head_dim: usize, kv: KvFormat) -> Result<KernelModule> {
    if head_dim == 0 || !head_dim.is_multiple_of(32) || head_dim > 32 * ATTENTION.len() {
        return Err(KernelError::Unsupported(format!(
            "decode attention over heads of {head_dim} values (multiples of 32 up to 256 only)"
        )));
    }
    let table = match kv {
        KvFormat::F16 => &ATTENTION,
        KvFormat::Q8_0 => &ATTENTION_Q8,
    };
    Ok(table[head_dim / 32 - 1])
}

pub const SAMPLE: KernelModule = module("sample", include_str!("../cuda/sample.cu"));

pub(crate) const GEMV_SRC: &str = include_str!("../cuda/gemv.cu");

/// gemv.cu with the grid I-quants' lattices defined after it (`cuda/iq_grids.cuh`, which
/// gemv.cu declares `extern`): the source of those types' modules only.
pub(crate) const GEMV_GRID_SRC: &str = concat!(
    include_str!("../cuda/gemv.cu"),
    "\n",
    include_str!("../cuda/iq_grids.cuh")
);

pub const PREFILL: KernelModule = module("prefill", include_str!("../cuda/prefill.cu"));

impl KernelModule {
    /// A per-weight-format module: `source` followed by its instantiation line (see
    /// `format::FORMATS`, which builds one GEMV and one dequantisation module per format).
    pub(crate) const fn with_suffix(
        name: &'static str,
        source: &'static str,
        suffix: &'static str,
    ) -> Self {
        KernelModule {
            name,
            source,
            suffix,
        }
    }
}

/// Every module, for compile checks.
pub fn all_modules() -> Vec<KernelModule> {
    let mut v = vec![NORM, ROPE, MOE, SAMPLE, PREFILL];
    v.extend(ATTENTION);
    v.extend(ATTENTION_Q8);
    for f in &crate::format::FORMATS {
        v.push(f.embed);
        v.extend(f.gemv.all());
        v.push(f.dequant);
        v.extend(f.batched);
    }
    v
}

/// Options for every compile. No fast-math: the kernels must track the CPU reference.
/// NVRTC options: `sm_XY` (a cubin) or, with `ptx`, the virtual `compute_XY` (PTX text).
fn options(arch: (i32, i32)) -> Vec<String> {
    vec![
        format!("--gpu-architecture=sm_{}{}", arch.0, arch.1),
        "--std=c++17".into(),
        "-lineinfo".into(),
        // Not every module uses every helper of common.cuh.
        "--diag-suppress=177".into(),
    ]
}

/// NVRTC's version, e.g. (13, 0).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    libs::nvrtc_status().map_err(KernelError::NoNvrtc)?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC is loaded (checked above); the out-pointers are valid.
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    status
        .result()
        .map_err(|e| KernelError::NoNvrtc(format!("nvrtcVersion failed: {e:?}")))?;
    Ok((major, minor))
}

/// Compiles `module` for `arch` without touching the cache.
pub fn compile_uncached(module: &KernelModule, arch: (i32, i32)) -> Result<Vec<u8>> {
    nvrtc(module, arch, Output::Cubin).map(|c| c.cubin)
}

/// `module` compiled for `arch`: its cubin and the PTX the compilation made on the way
/// (what tests inspect; kiln loads cubins).
pub fn compile_cubin_and_ptx(module: &KernelModule, arch: (i32, i32)) -> Result<Compiled> {
    nvrtc(module, arch, Output::Both)
}

/// What a compilation gave: the PTX is empty when not asked for.
#[derive(Debug, Clone, Default)]
pub struct Compiled {
    pub cubin: Vec<u8>,
    pub ptx: String,
}

#[derive(Clone, Copy, PartialEq)]
enum Output {
    Cubin,
    Both,
}

/// One NVRTC compilation, with what `output` asks of it.
fn nvrtc(module: &KernelModule, arch: (i32, i32), output: Output) -> Result<Compiled> {
    use cudarc::nvrtc::{result as nv, sys};
    libs::nvrtc_status().map_err(KernelError::NoNvrtc)?;
    let arch_name = format!("sm_{}{}", arch.0, arch.1);
    let src = CString::new(module.source())
        .map_err(|_| KernelError::InvalidArgument("kernel source holds a NUL".into()))?;
    let name = CString::new(format!("{}.cu", module.name)).expect("module names hold no NUL");
    let fail = |status: String, log: String| KernelError::Compile {
        module: module.name.to_string(),
        arch: arch_name.clone(),
        status,
        log,
    };
    let prog =
        nv::create_program(&src, Some(&name)).map_err(|e| fail(format!("{e:?}"), String::new()))?;
    // The program is destroyed on every path out of this block.
    let out = (|| {
        // SAFETY: `prog` is live until destroyed below.
        let compiled = unsafe { nv::compile_program(prog, &options(arch)) };
        // SAFETY: `prog` is live until destroyed below.
        let log = unsafe { nv::get_program_log(prog) }
            .map(|l| c_chars_to_string(&l))
            .unwrap_or_default();
        if let Err(e) = compiled {
            return Err(fail(format!("{e:?}"), log));
        }
        let mut result = Compiled::default();
        if output == Output::Both {
            let mut size = 0usize;
            // SAFETY: `prog` compiled; NVRTC writes the size.
            unsafe { sys::nvrtcGetPTXSize(prog, &mut size) }
                .result()
                .map_err(|e| fail(format!("{e:?}"), log.clone()))?;
            let mut ptx = vec![0u8; size];
            // SAFETY: `ptx` holds the `size` bytes NVRTC reported for this program.
            unsafe { sys::nvrtcGetPTX(prog, ptx.as_mut_ptr() as *mut c_char) }
                .result()
                .map_err(|e| fail(format!("{e:?}"), log.clone()))?;
            result.ptx = String::from_utf8_lossy(&ptx)
                .trim_end_matches('\0')
                .to_string();
        }
        let mut size = 0usize;
        // SAFETY: `prog` compiled; NVRTC writes the size.
        unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }
            .result()
            .map_err(|e| fail(format!("{e:?}"), log.clone()))?;
        result.cubin = vec![0u8; size];
        // SAFETY: `result.cubin` holds the `size` bytes NVRTC reported for this program.
        unsafe { sys::nvrtcGetCUBIN(prog, result.cubin.as_mut_ptr() as *mut c_char) }
            .result()
            .map_err(|e| fail(format!("{e:?}"), log.clone()))?;
        Ok(result)
    })();
    // SAFETY: created above, destroyed once.
    let _ = unsafe { nv::destroy_program(prog) };
    out
}

fn c_chars_to_string(v: &[c_char]) -> String {
    let bytes: Vec<u8> = v
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).trim().to_string()
}

/// The directory compiled kernels are cached in.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KILN_KERNEL_CACHE") {
        return Some(PathBuf::from(p));
    }
    dirs::cache_dir().map(|d| d.join("kiln").join("kernels"))
}

/// Compiles `module` for `arch`, or loads the cubin a previous run cached. `driver_version`
/// (from `cuDriverGetVersion`, 0 when none) is part of the key.
pub fn compile(module: &KernelModule, arch: (i32, i32), driver_version: i32) -> Result<Vec<u8>> {
    let file = cache_file(module, arch, driver_version)?;
    if let Some(bytes) = file.as_deref().and_then(read_cached) {
        return Ok(bytes);
    }
    let cubin = compile_uncached(module, arch)?;
    if let Some(f) = &file {
        // A cache that cannot be written only costs a recompile next time.
        let _ = write_atomically(f, &cubin);
    }
    Ok(cubin)
}

/// [`compile`] for several modules: cached ones read, the rest compiled in parallel (NVRTC
/// compiles independent programs concurrently), one thread per core. A first run on a GPU
/// says on stderr what it compiles and how long it took, so nobody waits in silence.
pub fn compile_many(
    modules: &[KernelModule],
    arch: (i32, i32),
    driver_version: i32,
) -> Result<Vec<Vec<u8>>> {
    let mut out: Vec<Option<Vec<u8>>> = Vec::with_capacity(modules.len());
    let mut files = Vec::with_capacity(modules.len());
    for m in modules {
        let file = cache_file(m, arch, driver_version)?;
        out.push(file.as_deref().and_then(read_cached));
        files.push(file);
    }
    let missing: Vec<usize> = (0..modules.len()).filter(|&i| out[i].is_none()).collect();
    if missing.is_empty() {
        return Ok(out.into_iter().map(|c| c.expect("all cached")).collect());
    }
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(missing.len());
    let start = std::time::Instant::now();
    eprintln!(
        "kiln: compiling {} GPU kernel module{} for sm_{}{} on {threads} thread{} (once per GPU and driver; cached afterwards) …",
        missing.len(),
        if missing.len() == 1 { "" } else { "s" },
        arch.0,
        arch.1,
        if threads == 1 { "" } else { "s" }
    );
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<(usize, Result<Vec<u8>>)> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&i) = missing.get(k) else { break };
                        done.push((i, compile_uncached(&modules[i], arch)));
                    }
                    done
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|h| h.join().expect("a compile thread panicked"))
            .collect()
    });
    for (i, cubin) in results {
        let cubin = cubin?;
        if let Some(f) = &files[i] {
            let _ = write_atomically(f, &cubin);
        }
        out[i] = Some(cubin);
    }
    eprintln!("kiln: compiled in {:.1} s", start.elapsed().as_secs_f64());
    Ok(out
        .into_iter()
        .map(|c| c.expect("compiled or cached"))
        .collect())
}

fn read_cached(f: &std::path::Path) -> Option<Vec<u8>> {
    std::fs::read(f).ok().filter(|b| is_elf(b))
}

/// Where the cubin of `module` for `arch` under this NVRTC and driver is cached, if a cache
/// directory exists: the name carries a hash of everything the result depends on.
fn cache_file(
    module: &KernelModule,
    arch: (i32, i32),
    driver_version: i32,
) -> Result<Option<PathBuf>> {
    let nvrtc = nvrtc_version()?;
    let mut h = Sha256::new();
    h.update(module.source().as_bytes());
    h.update(options(arch).join(" ").as_bytes());
    h.update(format!("nvrtc {}.{} driver {driver_version}", nvrtc.0, nvrtc.1).as_bytes());
    let digest = h.finalize();
    let key: String = digest.iter().take(12).map(|b| format!("{b:02x}")).collect();
    Ok(cache_dir().map(|d| {
        d.join(format!(
            "{}-sm_{}{}-{key}.cubin",
            module.name, arch.0, arch.1
        ))
    }))
}

fn is_elf(b: &[u8]) -> bool {
    b.len() > 4 && &b[..4] == b"\x7fELF"
}

fn write_atomically(file: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = file.parent().expect("cache files live in a directory");
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(
        ".{}.{}",
        file.file_name().unwrap().to_string_lossy(),
        std::process::id()
    ));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, file)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parameter lists of every `__global__` function in `text`, the GEMVs' shared
    /// `GEMV_PARAMS` expanded: (name, parameter count).
    fn kernel_parameters(text: &str) -> Vec<(String, usize)> {
        let gemv_params = text.find("#define GEMV_PARAMS").map(|at| {
            text[at + "#define GEMV_PARAMS".len()..]
                .lines()
                .scan(true, |more, line| {
                    let keep = *more;
                    *more = line.trim_end().ends_with('\\');
                    keep.then(|| line.trim_end().trim_end_matches('\\').to_string())
                })
                .collect::<Vec<_>>()
                .join(" ")
        });
        let mut out = Vec::new();
        let mut rest = text;
        while let Some(at) = rest.find("__global__") {
            rest = &rest[at + "__global__".len()..];
            let closing = |text: &str, open: usize| {
                let mut depth = 0;
                text[open..]
                    .char_indices()
                    .find(|&(_, c)| {
                        depth += (c == '(') as i32 - (c == ')') as i32;
                        depth == 0
                    })
                    .map(|(i, _)| open + i)
                    .expect("a closed parenthesis")
            };
            let mut open = rest.find('(').expect("a kernel's parameter list");
            // `__launch_bounds__(...)` comes before the name.
            if rest[..open].trim_end().ends_with("__launch_bounds__") {
                let after = closing(rest, open) + 1;
                open = after + rest[after..].find('(').expect("a kernel's parameter list");
            }
            let name = rest[..open]
                .split_whitespace()
                .last()
                .unwrap_or("")
                .to_string();
            let close = closing(rest, open);
            let mut list = rest[open + 1..close].to_string();
            if list.trim() == "GEMV_PARAMS" {
                list = gemv_params.clone().expect("GEMV_PARAMS is defined");
            }
            let count = if list.trim().is_empty() {
                0
            } else {
                list.matches(',').count() + 1
            };
            out.push((name, count));
            rest = &rest[close..];
        }
        out
    }

    /// A kernel with more parameters than `Args` holds would panic at its first launch, on
    /// the device only: every kernel of every module is held to the capacity here.
    #[test]
    fn every_kernels_parameters_fit_the_launch_arguments() {
        let mut longest = (String::new(), 0);
        for m in all_modules() {
            for (name, count) in kernel_parameters(&m.source()) {
                assert!(
                    count <= crate::device::Args::CAPACITY,
                    "{}: kernel {name} takes {count} parameters, Args holds {}",
                    m.name,
                    crate::device::Args::CAPACITY
                );
                if count > longest.1 {
                    longest = (name, count);
                }
            }
        }
        // The parse found the GEMVs' list (the longest).
        assert!(longest.1 >= 27, "longest parameter list {longest:?}");
    }
}
