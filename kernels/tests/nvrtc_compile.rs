//! Compiles every kernel module through NVRTC for sm_80 and sm_90 — no GPU needed, only
//! libnvrtc (found as `kiln_kernels::libs` describes; in CI the `nvidia-cuda-nvrtc` Python
//! wheel, or `KILN_NVRTC=/path/to/libnvrtc.so.13`). Without it the test reports a skip on stderr.

use std::sync::atomic::{AtomicUsize, Ordering};

use kiln_kernels::compile::{all_modules, compile_cubin_and_ptx, compile_uncached, nvrtc_version};
use kiln_kernels::libs;

/// Every module for sm_80 and sm_90, the (module, architecture) pairs spread over the
/// host's cores (one NVRTC compilation each: the test's whole cost in CI). Every kernel
/// is launched with programmatic dependent launch on sm_90, which is only safe if each one
/// waits for its predecessor before touching memory (see `grid_dependency_wait` in
/// common.cuh): a kernel without the wait could read a buffer its predecessor is still
/// writing — checked in the PTX the sm_90 compilations make on the way to their cubins.
#[test]
fn every_kernel_compiles_for_ampere_and_hopper_and_waits_for_its_predecessor() {
    let found = match libs::nvrtc_status() {
        Ok(where_) => where_,
        Err(why) => {
            kiln_kernels::testdata::skip(&format!("no libnvrtc ({why})"));
            return;
        }
    };
    let (major, minor) = nvrtc_version().expect("NVRTC loads");
    println!("NVRTC {major}.{minor} from {found}");
    let modules = all_modules();
    let jobs: Vec<(usize, (i32, i32))> = (0..modules.len())
        .flat_map(|m| [(m, (9, 0)), (m, (8, 0))])
        .collect();
    let next = AtomicUsize::new(0);
    let entries = AtomicUsize::new(0);
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let Some(&(m, arch)) = jobs.get(next.fetch_add(1, Ordering::Relaxed)) else {
                    return;
                };
                let m = &modules[m];
                let start = std::time::Instant::now();
                let compiled = compile_cubin_and_ptx(m, arch).unwrap_or_else(|e| panic!("{e}"));
                let took = start.elapsed().as_secs_f64();
                assert_eq!(
                    &compiled.cubin[..4],
                    b"\x7fELF",
                    "{} for sm_{}{} is not a cubin",
                    m.name,
                    arch.0,
                    arch.1
                );
                if arch == (9, 0) {
                    for entry in compiled.ptx.split(".entry ").skip(1) {
                        let name = entry.split('(').next().unwrap_or("?").trim();
                        assert!(
                            entry.contains("griddepcontrol.wait"),
                            "{}: kernel {name} never waits for the kernel before it",
                            m.name
                        );
                        entries.fetch_add(1, Ordering::Relaxed);
                    }
                }
                println!(
                    "compiled {} for sm_{}{}: {} bytes in {took:.2} s",
                    m.name,
                    arch.0,
                    arch.1,
                    compiled.cubin.len()
                );
            });
        }
    });
    let entries = entries.into_inner();
    assert!(
        entries > 100,
        "only {entries} kernel entry points found in the sm_90 PTX"
    );
    println!("{entries} kernels, each waits for its predecessor on sm_90");
}

#[test]
fn compile_errors_carry_the_nvrtc_log() {
    if let Err(why) = libs::nvrtc_status() {
        kiln_kernels::testdata::skip(&format!("no libnvrtc ({why})"));
        return;
    }
    let bad = kiln_kernels::compile::KernelModule::for_test(
        "broken",
        "extern \"C\" __global__ void k() { undeclared_name = 1; }",
    );
    match compile_uncached(&bad, (9, 0)) {
        Err(kiln_kernels::KernelError::Compile { log, module, .. }) => {
            assert_eq!(module, "broken");
            assert!(log.contains("undeclared_name"), "log: {log}");
        }
        other => panic!("expected a compile error, got {:?}", other.map(|c| c.len())),
    }
}

/// Several modules compiled at once (in parallel, as an executor's first load does) give
/// the very cubins one-at-a-time compiles give, and a second call reads them all from the
/// cache without compiling.
#[test]
fn modules_compiled_in_parallel_equal_one_at_a_time_and_are_cached() {
    if let Err(why) = libs::nvrtc_status() {
        kiln_kernels::testdata::skip(&format!("no libnvrtc ({why})"));
        return;
    }
    use kiln_kernels::compile::{compile_many, NORM, ROPE, SAMPLE};
    let cache = std::env::temp_dir().join(format!("kiln-kernel-cache-{}", std::process::id()));
    std::env::set_var("KILN_KERNEL_CACHE", &cache);
    let modules = [NORM, ROPE, SAMPLE];
    let t = std::time::Instant::now();
    let parallel = compile_many(&modules, (9, 0), 0).unwrap();
    let cold = t.elapsed();
    for (m, cubin) in modules.iter().zip(&parallel) {
        assert_eq!(cubin, &compile_uncached(m, (9, 0)).unwrap(), "{}", m.name);
    }
    let t = std::time::Instant::now();
    let cached = compile_many(&modules, (9, 0), 0).unwrap();
    let warm = t.elapsed();
    assert_eq!(cached, parallel);
    assert_eq!(
        std::fs::read_dir(&cache).unwrap().count(),
        modules.len(),
        "one cache file per module"
    );
    println!("3 modules: {cold:?} compiling in parallel, {warm:?} from the cache");
    assert!(warm < cold, "the second call must not compile");
    std::fs::remove_dir_all(&cache).ok();
}
