//! Every fused row-dot kernel (AVX2 and portable) against kiln-core's reference
//! dequantiser followed by a plain f64 dot, on fresh random blocks.

mod common;

use common::{random_bytes, random_vec};
use kiln_backend_cpu::kernels::{block_sums, dot4_f32, dot_f32, simd_available, Act, Kernel, RowDot, SUPPORTED};
use kiln_core::{quant::dequantize, QType, Rng};

fn row_lengths(q: QType) -> Vec<usize> {
    match q.block_len() {
        1 => vec![1, 7, 37, 64, 576, 1000],
        32 => vec![32, 96, 576, 1536],
        _ => vec![256, 512, 1536],
    }
}

fn paths() -> Vec<bool> {
    if simd_available() {
        vec![false, true]
    } else {
        println!("note: no AVX2/FMA/F16C here; only the portable kernels are tested");
        vec![false]
    }
}

#[test]
fn fused_dots_match_reference_dequantisation() {
    let mut rng = Rng::new(7);
    for q in SUPPORTED {
        for cols in row_lengths(q) {
            let rows = 5;
            let bytes = random_bytes(&mut rng, q, rows, cols, 1.0);
            let x = random_vec(&mut rng, cols, 2.0);
            let mut sums = vec![0.0; cols / 32];
            block_sums(&x, &mut sums);
            let row_bytes = q.row_bytes(cols).unwrap();
            let mut w = vec![0.0f32; cols];
            let mut expect = Vec::new();
            let mut magnitude = Vec::new();
            for r in 0..rows {
                dequantize(q, &bytes[r * row_bytes..(r + 1) * row_bytes], &mut w).unwrap();
                expect.push(w.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>());
                magnitude.push(w.iter().zip(&x).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum::<f64>());
            }
            for simd in paths() {
                let kernel = Kernel::new(q, simd).unwrap();
                let mut out = vec![f32::NAN; rows];
                kernel.dot_rows(&bytes, row_bytes, Act { x: &x, sums: &sums }, &mut out);
                for r in 0..rows {
                    let err = (out[r] as f64 - expect[r]).abs();
                    assert!(
                        err <= 1e-5 * magnitude[r] + 1e-6,
                        "{q} cols {cols} row {r} simd {simd}: got {} want {} (err {err:e}, Σ|wx| {})",
                        out[r],
                        expect[r],
                        magnitude[r]
                    );
                }
            }
        }
    }
}

#[test]
fn row_dequantisation_matches_reference_bit_for_bit() {
    let mut rng = Rng::new(11);
    for q in SUPPORTED {
        for cols in row_lengths(q) {
            let bytes = random_bytes(&mut rng, q, 1, cols, 3.0);
            let mut want = vec![0.0f32; cols];
            dequantize(q, &bytes, &mut want).unwrap();
            let mut got = vec![f32::NAN; cols];
            Kernel::new(q, false).unwrap().dequant_row(&bytes, &mut got);
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{q} cols {cols} value {i}: {a} vs {b}");
            }
        }
    }
}

#[test]
fn unsupported_types_have_no_kernel() {
    for q in [QType::Q8_1, QType::Q8_K] {
        assert!(Kernel::new(q, true).is_none(), "{q}");
        assert!(!SUPPORTED.contains(&q));
    }
}

#[test]
fn f32_dot_handles_every_tail_length() {
    let mut rng = Rng::new(3);
    for n in 0..80 {
        let a = random_vec(&mut rng, n, 1.0);
        let b = random_vec(&mut rng, n, 1.0);
        let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
        for simd in paths() {
            let got = dot_f32(simd, &a, &b);
            assert!((got as f64 - want).abs() < 1e-5, "n {n} simd {simd}: {got} vs {want}");
            let neg: Vec<f32> = b.iter().map(|v| -v).collect();
            let four = dot4_f32(simd, &a, [&b, &neg, &a, &b]);
            let self_dot: f64 = a.iter().map(|x| *x as f64 * *x as f64).sum();
            for (got, want) in four.iter().zip([want, -want, self_dot, want]) {
                assert!((*got as f64 - want).abs() < 1e-5, "dot4 n {n} simd {simd}: {got} vs {want}");
            }
        }
    }
}
