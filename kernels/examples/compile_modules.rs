//! Compiles the kernel modules whose names contain any of the arguments (all without
//! arguments) through NVRTC for sm_90 and prints each one's size and compile time: a quick
//! check of a CUDA change without a GPU.
//!
//! `cargo run --release -p kiln-kernels --example compile_modules -- [--regs] bmm_q4_k attention`
//!
//! `--regs` also lists each kernel's registers per thread (read from the cubin's ELF
//! section headers: ptxas stores a kernel's register count in the top byte of its
//! `.text.<kernel>` section's `sh_info`), which decides how many threads an SM holds.

use std::time::Instant;

use kiln_kernels::compile::{all_modules, compile_uncached};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let regs = args.iter().any(|a| a == "--regs");
    let filters: Vec<String> = args.into_iter().filter(|a| a != "--regs").collect();
    let mut failed = false;
    for m in all_modules() {
        if !filters.is_empty() && !filters.iter().any(|f| m.name.contains(f.as_str())) {
            continue;
        }
        let t = Instant::now();
        match compile_uncached(&m, (9, 0)) {
            Ok(cubin) => {
                println!(
                    "{:<16} {:>9} bytes  {:.1} s",
                    m.name,
                    cubin.len(),
                    t.elapsed().as_secs_f64()
                );
                if regs {
                    for (kernel, n) in kernel_registers(&cubin) {
                        println!("    {n:>3} registers  {kernel}");
                    }
                }
            }
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

/// (kernel name, registers per thread) for every kernel of an ELF64 cubin; empty if the
/// bytes are not one. ptxas records each kernel's count as an `EIATTR_REGCOUNT` attribute
/// (0x2f: symbol index, count) in the `.nv.info` section; a kernel's code section
/// `.text.<kernel>` names its symbol in `sh_info`.
fn kernel_registers(elf: &[u8]) -> Vec<(String, u32)> {
    let u16_at = |o: usize| {
        elf.get(o..o + 2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]) as usize)
    };
    let u32_at = |o: usize| {
        elf.get(o..o + 4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
    };
    let u64_at = |o: usize| {
        elf.get(o..o + 8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap()) as usize)
    };
    let parse = || -> Option<Vec<(String, u32)>> {
        if elf.get(..5)? != b"\x7fELF\x02" {
            return None;
        }
        let (shoff, shentsize, shnum, shstrndx) =
            (u64_at(0x28)?, u16_at(0x3a)?, u16_at(0x3c)?, u16_at(0x3e)?);
        let header = |i: usize| shoff + i * shentsize;
        let names = u64_at(header(shstrndx) + 0x18)?;
        let mut kernels = Vec::new(); // (name, symbol index)
        let mut counts = std::collections::HashMap::new(); // symbol index -> registers
        for i in 0..shnum {
            let h = header(i);
            let name_at = names + u32_at(h)? as usize;
            let end = elf.get(name_at..)?.iter().position(|&b| b == 0)?;
            let name = std::str::from_utf8(&elf[name_at..name_at + end]).ok()?;
            if let Some(kernel) = name.strip_prefix(".text.") {
                kernels.push((kernel.to_string(), u32_at(h + 0x2c)?));
            } else if name == ".nv.info" {
                let (start, len) = (u64_at(h + 0x18)?, u64_at(h + 0x20)?);
                let mut at = start;
                while at + 4 <= start + len {
                    let (format, attr, size) = (elf[at], elf[at + 1], u16_at(at + 2)?);
                    // Format 4 (a sized value) carries `size` bytes; the others none.
                    let payload = if format == 4 { size } else { 0 };
                    if attr == 0x2f && payload == 8 {
                        counts.insert(u32_at(at + 4)?, u32_at(at + 8)?);
                    }
                    at += 4 + payload;
                }
            }
        }
        Some(
            kernels
                .into_iter()
                .filter_map(|(k, sym)| counts.get(&sym).map(|&n| (k, n)))
                .collect(),
        )
    };
    parse().unwrap_or_default()
}
