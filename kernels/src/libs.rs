//! Finding the CUDA driver and NVRTC at run time.
//!
//! cudarc loads `libcuda` and `libnvrtc` by name on first use and panics when they are
//! missing, so every entry point of this crate asks here first and turns absence into an
//! error.
//!
//! NVRTC is looked for, in order: at `KILN_NVRTC` (the library file, or a directory holding
//! `libnvrtc.so.13`); by the dynamic loader's own search (`LD_LIBRARY_PATH`, the system
//! cache); in the toolkit's usual homes (`$CUDA_HOME/lib64`, `/usr/local/cuda/lib64`); and
//! in Python environments where the `nvidia-cuda-nvrtc` wheel puts it
//! (`site-packages/nvidia/cu13/lib`). A library found by path is loaded once and kept
//! loaded; the loader then resolves cudarc's later load by name (the library's soname) to
//! that same copy.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

const NVRTC_NAMES: [&str; 2] = ["libnvrtc.so.13", "libnvrtc.so"];

/// `Ok(())` when libcuda can be loaded, else why not. Cached.
pub fn driver_status() -> Result<(), String> {
    static STATUS: OnceLock<Result<(), String>> = OnceLock::new();
    STATUS
        .get_or_init(|| {
            // SAFETY: loading libcuda runs only its initialisers; nothing else is called.
            if unsafe { cudarc::driver::sys::is_culib_present() } {
                Ok(())
            } else {
                Err("libcuda.so could not be loaded (no NVIDIA driver installed, or not on the loader path)".into())
            }
        })
        .clone()
}

/// Where NVRTC was found (`Ok(description)`), or why it was not. Cached.
pub fn nvrtc_status() -> Result<String, String> {
    static STATUS: OnceLock<Result<String, String>> = OnceLock::new();
    STATUS.get_or_init(find_nvrtc).clone()
}

fn find_nvrtc() -> Result<String, String> {
    if let Some(path) = std::env::var_os("KILN_NVRTC") {
        let path = PathBuf::from(path);
        let file = if path.is_dir() {
            NVRTC_NAMES
                .iter()
                .map(|n| path.join(n))
                .find(|p| p.exists())
        } else {
            Some(path.clone())
        };
        return match file {
            Some(f) => preload(&f).map(|_| format!("{} (KILN_NVRTC)", f.display())),
            None => Err(format!("KILN_NVRTC={} holds no libnvrtc", path.display())),
        };
    }
    // SAFETY: as for libcuda above.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Ok("libnvrtc from the loader path".into());
    }
    let mut tried = Vec::new();
    for dir in candidate_dirs() {
        for name in NVRTC_NAMES {
            let f = dir.join(name);
            if f.exists() {
                match preload(&f) {
                    Ok(()) => return Ok(f.display().to_string()),
                    Err(e) => tried.push(e),
                }
            }
        }
    }
    let mut why = "libnvrtc.so.13 not found on the loader path, in /usr/local/cuda or in a Python \
                   environment's nvidia-cuda-nvrtc package; set KILN_NVRTC to its path"
        .to_string();
    if !tried.is_empty() {
        why.push_str(&format!(" (found but unusable: {})", tried.join("; ")));
    }
    Err(why)
}

/// Where cuBLAS was found (`Ok(description)`), or why it was not. Cached. Looked for at
/// `KILN_CUBLAS` (file or directory), on the loader path, then in the places NVRTC is
/// looked for; a copy found by path is loaded (after its `libcublasLt` neighbour, which it
/// needs and may have no run path to find) and kept loaded, so cudarc's load by soname
/// resolves to it.
pub fn cublas_status() -> Result<String, String> {
    static STATUS: OnceLock<Result<String, String>> = OnceLock::new();
    STATUS.get_or_init(find_cublas).clone()
}

fn find_cublas() -> Result<String, String> {
    const NAMES: [&str; 2] = ["libcublas.so.13", "libcublas.so"];
    let mut dirs = Vec::new();
    if let Some(path) = std::env::var_os("KILN_CUBLAS") {
        let path = PathBuf::from(path);
        if path.is_file() {
            return preload_cublas(&path).map(|_| format!("{} (KILN_CUBLAS)", path.display()));
        }
        dirs.push(path);
    } else {
        // SAFETY: loading libcublas runs only its initialisers; nothing else is called.
        if unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Ok("libcublas from the loader path".into());
        }
    }
    dirs.extend(candidate_dirs());
    let mut tried = Vec::new();
    for dir in dirs {
        for name in NAMES {
            let f = dir.join(name);
            if f.exists() {
                match preload_cublas(&f) {
                    Ok(()) => return Ok(f.display().to_string()),
                    Err(e) => tried.push(e),
                }
            }
        }
    }
    let mut why =
        "libcublas.so.13 not found on the loader path, in /usr/local/cuda or in a Python \
                   environment's nvidia-cublas package; set KILN_CUBLAS to its path"
            .to_string();
    if !tried.is_empty() {
        why.push_str(&format!(" (found but unusable: {})", tried.join("; ")));
    }
    Err(why)
}

fn preload_cublas(file: &Path) -> Result<(), String> {
    if let Some(dir) = file.parent() {
        for lt in ["libcublasLt.so.13", "libcublasLt.so"] {
            let p = dir.join(lt);
            if p.exists() {
                // SAFETY: as below; a failure surfaces when libcublas itself is loaded.
                if let Ok(lib) = unsafe { libloading::Library::new(&p) } {
                    std::mem::forget(lib);
                    break;
                }
            }
        }
    }
    // SAFETY: libcublas's initialisers have no preconditions.
    let lib = unsafe { libloading::Library::new(file) }
        .map_err(|e| format!("{}: {e}", file.display()))?;
    std::mem::forget(lib);
    // SAFETY: as above.
    if unsafe { cudarc::cublas::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(format!(
            "{} loaded but its soname does not resolve",
            file.display()
        ))
    }
}

fn preload(file: &Path) -> Result<(), String> {
    // libnvrtc opens its builtins library by name at compile time; some builds (the 13.0
    // wheel) carry no run path to find it beside them, so load it from there first.
    if let Some(dir) = file.parent() {
        for builtins in read_dir_sorted(dir) {
            let name = builtins.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if name.starts_with("libnvrtc-builtins.so") {
                // SAFETY: as below; a failure here surfaces later as a compile error.
                if let Ok(lib) = unsafe { libloading::Library::new(&builtins) } {
                    std::mem::forget(lib);
                }
            }
        }
    }
    // SAFETY: libnvrtc's initialisers have no preconditions.
    let lib = unsafe { libloading::Library::new(file) }
        .map_err(|e| format!("{}: {e}", file.display()))?;
    // Kept loaded for the life of the process so the later load by soname finds it.
    std::mem::forget(lib);
    // SAFETY: as above.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(format!(
            "{} loaded but its soname does not resolve",
            file.display()
        ))
    }
}

fn candidate_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(v) = std::env::var_os(var) {
            dirs.push(PathBuf::from(v).join("lib64"));
        }
    }
    dirs.push("/usr/local/cuda/lib64".into());
    // Python environments: site-packages / dist-packages under these prefixes.
    let mut prefixes: Vec<PathBuf> = ["/usr/local/lib", "/usr/lib"]
        .iter()
        .map(PathBuf::from)
        .collect();
    if let Some(v) = std::env::var_os("VIRTUAL_ENV") {
        prefixes.push(PathBuf::from(v).join("lib"));
    }
    if let Some(home) = dirs::home_dir() {
        prefixes.push(home.join(".local/lib"));
        for versions in [home.join(".pyenv/versions")] {
            for v in read_dir_sorted(&versions) {
                prefixes.push(v.join("lib"));
            }
        }
    }
    for opt in read_dir_sorted(Path::new("/opt")) {
        prefixes.push(opt.join(".venv/lib"));
        prefixes.push(opt.join("lib"));
    }
    for prefix in prefixes {
        for py in read_dir_sorted(&prefix) {
            let is_python = py
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("python3"));
            if !is_python {
                continue;
            }
            for pkgs in ["site-packages", "dist-packages"] {
                let base = py.join(pkgs).join("nvidia");
                dirs.push(base.join("cu13/lib"));
                dirs.push(base.join("cuda_nvrtc/lib"));
            }
        }
    }
    dirs
}

fn read_dir_sorted(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| rd.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    // Newest interpreter / version last-sorted first.
    v.sort();
    v.reverse();
    v
}
