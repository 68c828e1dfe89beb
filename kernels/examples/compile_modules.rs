//! Compiles the kernel modules whose names contain any of the arguments (all without
//! arguments) through NVRTC for sm_90 and prints each one's size and compile time: a quick
//! check of a CUDA change without a GPU.
//!
//! `cargo run --release -p kiln-kernels --example compile_modules -- bmm_q4_k attention`

use std::time::Instant;

use kiln_kernels::compile::{all_modules, compile_uncached};

fn main() {
    let filters: Vec<String> = std::env::args().skip(1).collect();
    let mut failed = false;
    for m in all_modules() {
        if !filters.is_empty() && !filters.iter().any(|f| m.name.contains(f.as_str())) {
            continue;
        }
        let t = Instant::now();
        match compile_uncached(&m, (9, 0)) {
            Ok(cubin) => println!(
                "{:<16} {:>9} bytes  {:.1} s",
                m.name,
                cubin.len(),
                t.elapsed().as_secs_f64()
            ),
            Err(e) => {
                failed = true;
                eprintln!("{}: {e}", m.name);
            }
        }
    }
    if failed {
        std::process::exit(1);
    }
}
