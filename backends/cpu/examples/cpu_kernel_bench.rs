//! Speed of each fused row-dot kernel on one thread, per instruction set: a weight matrix
//! that stays in L2 (so the kernel's arithmetic, not memory, is measured) dotted with one
//! activation, repeated; the fastest of fifteen timings (the least disturbed: it measures
//! arithmetic, and on a shared host other work only ever slows a timing down), in weights
//! per nanosecond and weight-bytes per second. Beside each set's f32 kernel (the oracle's), the integer kernel
//! on 8-bit activations (`q8`, the opt-in fast path) where the type has one.
//!
//! ```text
//! cargo run --release -p kiln-backend-cpu --example cpu_kernel_bench [-- ROWS COLS [TYPE]]
//! ```

use std::time::Instant;

use kiln_backend_cpu::kernels::q8::{Q8Forms, Q8Input, Q8Kernel};
use kiln_backend_cpu::kernels::{block_sums, Act, Kernel, RowDot};
use kiln_backend_cpu::Isa;
use kiln_core::{QType, Rng};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let number = |i: usize, default: usize| {
        args.get(i)
            .map_or(default, |a| a.parse().expect("ROWS and COLS are numbers"))
    };
    let (rows, cols) = (number(0, 512), number(1, 1536));
    // A matrix larger than the caches (e.g. 8192 × 4608) measures the kernels streaming
    // from memory, as a decode step runs them; TYPE (e.g. q4_1) keeps one type.
    let only = args.get(2).map(|t| t.to_lowercase());
    let mut rng = Rng::new(1);
    let x: Vec<f32> = (0..cols).map(|_| rng.next_f32() * 2.0 - 1.0).collect();
    let mut sums = vec![0.0; cols / 32];
    block_sums(&x, &mut sums);
    let mut x8 = Q8Input::default();
    x8.quantize(
        &x,
        1,
        cols,
        Q8Forms {
            block: true,
            super_block: true,
        },
    );
    let isas = Isa::available();
    println!(
        "{rows} × {cols}, one thread; weights/ns per instruction set ({})",
        isas.iter().map(|i| i.name()).collect::<Vec<_>>().join(", ")
    );
    let types = [
        QType::Q4_0,
        QType::AprQ4,
        QType::Q4_1,
        QType::Q5_0,
        QType::Q5_1,
        QType::Q8_0,
        QType::Q4_K,
        QType::Q5_K,
        QType::Q6_K,
        QType::F16,
    ];
    for q in types {
        if only.as_ref().is_some_and(|t| *t != q.name()) {
            continue;
        }
        let Ok(row_bytes) = q.row_bytes(cols) else {
            continue;
        };
        let values: Vec<f32> = (0..rows * cols)
            .map(|_| rng.next_f32() * 2.0 - 1.0)
            .collect();
        let mut bytes = vec![0u8; rows * row_bytes];
        kiln_core::quant::quantize(q, &values, &mut bytes).expect("a quantisable type");
        let mut line = format!("{:<7}", q.name());
        let mut out = vec![0.0f32; rows];
        let mut report = |name: &str, run: &mut dyn FnMut(&mut [f32])| {
            let mut times = Vec::new();
            for _ in 0..15 {
                let reps = (20 * 1_000_000 / (rows * cols)).clamp(1, 20);
                let t = Instant::now();
                for _ in 0..reps {
                    run(&mut out);
                    std::hint::black_box(&mut out);
                }
                times.push(t.elapsed().as_secs_f64() / reps as f64);
            }
            let s = times.iter().copied().fold(f64::INFINITY, f64::min);
            line += &format!(
                "  {name:>12} {:6.2} w/ns {:6.1} GB/s",
                (rows * cols) as f64 / s / 1e9,
                (rows * row_bytes) as f64 / s / 1e9
            );
        };
        for &isa in &isas {
            let kernel = Kernel::new(q, isa).expect("a kernel for every listed type");
            let act = Act { x: &x, sums: &sums };
            report(isa.name(), &mut |out| {
                kernel.dot_rows(&bytes, row_bytes, act, out)
            });
            let k8 = Q8Kernel::new(q, isa);
            if let Some((k8, x8)) = k8.and_then(|k| Some((k, x8.form(k.span())?))) {
                let name = format!("{} q8", isa.name());
                report(&name, &mut |out| {
                    k8.dot_rows(&bytes, row_bytes, x8.token(0), out)
                });
            }
        }
        println!("{line}");
    }
}
