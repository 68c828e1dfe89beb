//! Compiles every kernel module through NVRTC for sm_80 and sm_90 — no GPU needed, only
//! libnvrtc (found as `kiln_kernels::libs` describes; in CI the `nvidia-cuda-nvrtc` Python
//! wheel, or `KILN_NVRTC=/path/to/libnvrtc.so.13`). Without it the test reports a skip on stderr.

use kiln_kernels::compile::{all_modules, compile_uncached, nvrtc_version};
use kiln_kernels::libs;

#[test]
fn every_kernel_compiles_for_ampere_and_hopper() {
    let found = match libs::nvrtc_status() {
        Ok(where_) => where_,
        Err(why) => {
            kiln_kernels::testdata::skip(&format!("no libnvrtc ({why})"));
            return;
        }
    };
    let (major, minor) = nvrtc_version().expect("NVRTC loads");
    println!("NVRTC {major}.{minor} from {found}");
    for arch in [(8, 0), (9, 0)] {
        for m in all_modules() {
            let cubin = compile_uncached(&m, arch).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(
                &cubin[..4],
                b"\x7fELF",
                "{} for sm_{}{} is not a cubin",
                m.name,
                arch.0,
                arch.1
            );
            println!(
                "compiled {} for sm_{}{}: {} bytes",
                m.name,
                arch.0,
                arch.1,
                cubin.len()
            );
        }
    }
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
