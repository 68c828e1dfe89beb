//! Every fused row-dot kernel (AVX2 and portable) against kiln-core's reference
//! dequantiser followed by a plain f64 dot, on fresh random blocks.

mod common;

use common::{random_bytes, random_vec};
use kiln_backend_cpu::kernels::{
    block_sums, dot4_f32, dot_f32, simd_available, supported, Act, Isa, Kernel, RowDot,
    TOKENS_AT_ONCE,
};
use kiln_core::{quant::dequantize, QType, Rng};

fn row_lengths(q: QType) -> Vec<usize> {
    match q.block_len() {
        1 => vec![1, 7, 37, 64, 576, 1000],
        32 => vec![32, 96, 576, 1536],
        _ => vec![256, 512, 1536],
    }
}

/// Every instruction set this CPU runs (each kernel path is checked on its own).
fn paths() -> Vec<Isa> {
    let isas = Isa::available();
    if !isas.contains(&Isa::Avx2) {
        println!("note: no AVX2/FMA/F16C here; only the portable kernels are tested");
    } else if !isas.contains(&Isa::Avx512) {
        println!("note: no AVX-512 here; its kernels are not tested on this machine");
    }
    isas
}

/// Runs both kernel paths over `rows` rows of `cols` values in `bytes` and checks each
/// dot against the reference dequantiser and an f64 dot.
fn assert_dots_match_reference(
    q: QType,
    bytes: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    what: &str,
) {
    let mut sums = vec![0.0; cols / 32];
    block_sums(x, &mut sums);
    let row_bytes = q.row_bytes(cols).unwrap();
    let mut w = vec![0.0f32; cols];
    let mut expect = Vec::new();
    let mut magnitude = Vec::new();
    for r in 0..rows {
        dequantize(q, &bytes[r * row_bytes..(r + 1) * row_bytes], &mut w).unwrap();
        expect.push(
            w.iter()
                .zip(x)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>(),
        );
        magnitude.push(
            w.iter()
                .zip(x)
                .map(|(a, b)| (*a as f64 * *b as f64).abs())
                .sum::<f64>(),
        );
    }
    for simd in paths() {
        let kernel = Kernel::new(q, simd).unwrap();
        let simd = simd.name();
        let mut out = vec![f32::NAN; rows];
        kernel.dot_rows(bytes, row_bytes, Act { x, sums: &sums }, &mut out);
        for r in 0..rows {
            let err = (out[r] as f64 - expect[r]).abs();
            assert!(
                err <= 1e-5 * magnitude[r] + 1e-6,
                "{q} cols {cols} row {r} simd {simd} {what}: got {} want {} (err {err:e}, Σ|wx| {})",
                out[r],
                expect[r],
                magnitude[r]
            );
        }
    }
}

#[test]
fn fused_dots_match_reference_dequantisation() {
    let mut rng = Rng::new(7);
    for q in supported() {
        for cols in row_lengths(q) {
            let rows = 5;
            let bytes = random_bytes(&mut rng, q, rows, cols, 1.0);
            let x = random_vec(&mut rng, cols, 2.0);
            assert_dots_match_reference(q, &bytes, rows, cols, &x, "random");
        }
    }
}

/// The few-token product of batched decode (each weight decoded once for up to four
/// activations): every type, every path, one to four tokens, row counts that do and do not
/// fill the kernels' row groups, each result against the reference dequantiser and an f64
/// dot. Outputs start as NaN, so a row or token left unwritten fails.
#[test]
fn few_token_dots_match_reference_dequantisation() {
    let mut rng = Rng::new(11);
    for q in supported() {
        let cols = *row_lengths(q).last().unwrap();
        for rows in [1, 2, 5, 7] {
            let bytes = random_bytes(&mut rng, q, rows, cols, 1.0);
            let row_bytes = q.row_bytes(cols).unwrap();
            let xs: Vec<Vec<f32>> = (0..TOKENS_AT_ONCE)
                .map(|_| random_vec(&mut rng, cols, 2.0))
                .collect();
            let sums: Vec<Vec<f32>> = xs
                .iter()
                .map(|x| {
                    let mut s = vec![0.0; cols / 32];
                    block_sums(x, &mut s);
                    s
                })
                .collect();
            let mut w = vec![0.0f32; cols];
            // expect[r][t], magnitude[r][t]
            let mut expect = vec![[0.0f64; TOKENS_AT_ONCE]; rows];
            let mut magnitude = vec![[0.0f64; TOKENS_AT_ONCE]; rows];
            for r in 0..rows {
                dequantize(q, &bytes[r * row_bytes..(r + 1) * row_bytes], &mut w).unwrap();
                for (t, x) in xs.iter().enumerate() {
                    expect[r][t] = w.iter().zip(x).map(|(a, b)| *a as f64 * *b as f64).sum();
                    magnitude[r][t] = w
                        .iter()
                        .zip(x)
                        .map(|(a, b)| (*a as f64 * *b as f64).abs())
                        .sum();
                }
            }
            for isa in paths() {
                let kernel = Kernel::new(q, isa).unwrap();
                for tokens in 1..=TOKENS_AT_ONCE {
                    let acts: Vec<Act<'_>> = (0..tokens)
                        .map(|t| Act {
                            x: &xs[t],
                            sums: &sums[t],
                        })
                        .collect();
                    let mut out = vec![vec![f32::NAN; rows]; tokens];
                    let mut outs: Vec<&mut [f32]> =
                        out.iter_mut().map(|o| o.as_mut_slice()).collect();
                    kernel.dot_rows_tokens(&bytes, row_bytes, &acts, &mut outs);
                    for r in 0..rows {
                        for t in 0..tokens {
                            let err = (out[t][r] as f64 - expect[r][t]).abs();
                            assert!(
                                err <= 1e-5 * magnitude[r][t] + 1e-6,
                                "{q} {} rows {rows} tokens {tokens}: row {r} token {t} got {} want {} (err {err:e})",
                                isa.name(),
                                out[t][r],
                                expect[r][t]
                            );
                        }
                    }
                }
            }
        }
    }
}

/// The Q5 types keep each value's fifth bit in a separate bit field, which the AVX2
/// kernels spread back onto bytes. Random fields set about half the bits; all-clear,
/// all-set and walking patterns make a bit-order slip (a value off by 16·scale) certain
/// to show rather than likely.
#[test]
fn q5_fifth_bit_fields_match_reference() {
    let mut rng = Rng::new(13);
    let cases = [
        (QType::Q5_0, 576, 2..6),
        (QType::Q5_1, 576, 4..8),
        (QType::Q5_K, 512, 16..48),
    ];
    for (q, cols, field) in cases {
        for pattern in [0x00u8, 0xFF, 0x01, 0x80, 0x55, 0x0F] {
            let rows = 3;
            let mut bytes = random_bytes(&mut rng, q, rows, cols, 1.0);
            for blk in bytes.chunks_exact_mut(q.block_bytes()) {
                for (k, b) in blk[field.clone()].iter_mut().enumerate() {
                    *b = pattern.rotate_left(k as u32);
                }
            }
            let x = random_vec(&mut rng, cols, 2.0);
            assert_dots_match_reference(
                q,
                &bytes,
                rows,
                cols,
                &x,
                &format!("fifth bits {pattern:#04x}"),
            );
        }
    }
}

/// The types with AVX2 kernels must actually select them when the CPU has the features,
/// or the comparison above would only ever exercise the portable path for them.
#[test]
fn simd_kernels_are_selected_when_available() {
    if !simd_available() {
        println!("skipped: no AVX2/FMA/F16C on this CPU");
        return;
    }
    let simd_types = [
        QType::F32,
        QType::F16,
        QType::BF16,
        QType::Q4_0,
        QType::Q4_1,
        QType::Q5_0,
        QType::Q5_1,
        QType::Q8_0,
        QType::Q4_K,
        QType::Q5_K,
        QType::Q6_K,
        QType::AprQ4,
        QType::MXFP4,
        QType::IQ4_NL,
    ];
    // The table types' AVX2 kernels (a byte shuffle a block) are what AVX-512 hosts run too.
    let avx2_only = [QType::F16, QType::MXFP4, QType::IQ4_NL];
    let wide = Isa::available().contains(&Isa::Avx512);
    for q in simd_types {
        let off = format!("{:?}", Kernel::new(q, Isa::Portable).unwrap());
        let on = format!("{:?}", Kernel::new(q, Isa::Avx2).unwrap());
        assert!(
            on.contains("Avx2(") && off.contains("simd: None"),
            "{q}: {on} / {off}"
        );
        // Every type but f16 (whose AVX2 kernel already streams at memory speed) and the
        // table types has AVX-512 kernels.
        let widest = format!("{:?}", Kernel::new(q, Isa::Avx512).unwrap());
        assert_eq!(
            widest.contains("Avx512("),
            wide && !avx2_only.contains(&q),
            "{q}: {widest}"
        );
    }
}

/// APR Q4 is Q4_0 with the nibbles in value order: on the same blocks, permuted to each
/// layout, both kernels must give the same dot bit for bit (same values, same lanes, same
/// order of operations), on both paths. A nibble-order slip shows as a wrong sum here even
/// where the random-block comparison's tolerance might absorb it.
#[test]
fn apr_q4_dots_equal_q4_0_dots_of_the_permuted_blocks() {
    let mut rng = Rng::new(17);
    for cols in [32, 96, 576, 1536] {
        let rows = 4;
        let apr = random_bytes(&mut rng, QType::AprQ4, rows, cols, 1.0);
        let q40: Vec<u8> = apr
            .chunks_exact(18)
            .flat_map(|b| kiln_core::quant::apr_q4_block_to_q4_0(b.try_into().unwrap()))
            .collect();
        let x = random_vec(&mut rng, cols, 2.0);
        let mut sums = vec![0.0; cols / 32];
        block_sums(&x, &mut sums);
        let row_bytes = QType::AprQ4.row_bytes(cols).unwrap();
        for simd in paths() {
            let mut got = vec![f32::NAN; rows];
            let mut want = vec![f32::NAN; rows];
            Kernel::new(QType::AprQ4, simd).unwrap().dot_rows(
                &apr,
                row_bytes,
                Act { x: &x, sums: &sums },
                &mut got,
            );
            Kernel::new(QType::Q4_0, simd).unwrap().dot_rows(
                &q40,
                row_bytes,
                Act { x: &x, sums: &sums },
                &mut want,
            );
            for r in 0..rows {
                let (g, w) = (got[r], want[r]);
                assert_eq!(
                    g.to_bits(),
                    w.to_bits(),
                    "cols {cols} row {r} simd {simd:?}: {g} vs {w}"
                );
            }
        }
    }
}

#[test]
fn row_dequantisation_matches_reference_bit_for_bit() {
    let mut rng = Rng::new(11);
    for q in supported() {
        for cols in row_lengths(q) {
            let bytes = random_bytes(&mut rng, q, 1, cols, 3.0);
            let mut want = vec![0.0f32; cols];
            dequantize(q, &bytes, &mut want).unwrap();
            for isa in paths() {
                let mut got = vec![f32::NAN; cols];
                Kernel::new(q, isa).unwrap().dequant_row(&bytes, &mut got);
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{q} {isa:?} cols {cols} value {i}: {a} vs {b}"
                    );
                }
            }
        }
    }
}

#[test]
fn unsupported_types_have_no_kernel() {
    for q in [QType::Q8_1, QType::Q8_K] {
        assert!(Kernel::new(q, Isa::Avx512).is_none(), "{q}");
        assert!(!supported().contains(&q));
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
            let token = kiln_backend_cpu::kernels::Simd::detect(simd);
            let got = dot_f32(token, &a, &b);
            assert!(
                (got as f64 - want).abs() < 1e-5,
                "n {n} simd {simd:?}: {got} vs {want}"
            );
            let neg: Vec<f32> = b.iter().map(|v| -v).collect();
            let four = dot4_f32(token, &a, [&b, &neg, &a, &b]);
            let self_dot: f64 = a.iter().map(|x| *x as f64 * *x as f64).sum();
            for (got, want) in four.iter().zip([want, -want, self_dot, want]) {
                assert!(
                    (*got as f64 - want).abs() < 1e-5,
                    "dot4 n {n} simd {simd:?}: {got} vs {want}"
                );
            }
        }
    }
}

/// The safe SIMD entry points check the row length on every call (release builds too):
/// a row shorter than the activation needs is a panic, never an out-of-bounds read.
#[test]
fn simd_kernels_refuse_rows_of_the_wrong_length() {
    if !simd_available() {
        println!("skipped: no AVX2/FMA/F16C on this CPU");
        return;
    }
    let x = vec![1.0f32; 64];
    let sums = vec![32.0f32; 2];
    for isa in Isa::available()
        .into_iter()
        .filter(|&isa| isa != Isa::Portable)
    {
        for q in [
            QType::Q4_0,
            QType::Q4_1,
            QType::Q5_0,
            QType::Q8_0,
            QType::F16,
        ] {
            let k = Kernel::new(q, isa).unwrap();
            let short = vec![0u8; q.row_bytes(32).unwrap()];
            let r = std::panic::catch_unwind(|| {
                let mut out = [0f32; 1];
                k.dot_rows(&short, short.len(), Act { x: &x, sums: &sums }, &mut out);
            });
            assert!(
                r.is_err(),
                "{q} {isa:?}: a 32-value row against 64 activations must be refused"
            );
        }
        let x = vec![1.0f32; 512];
        let sums = vec![32.0f32; 16];
        for q in [QType::Q4_K, QType::Q5_K, QType::Q6_K] {
            let k = Kernel::new(q, isa).unwrap();
            let short = vec![0u8; q.row_bytes(256).unwrap()];
            let r = std::panic::catch_unwind(|| {
                let mut out = [0f32; 1];
                k.dot_rows(&short, short.len(), Act { x: &x, sums: &sums }, &mut out);
            });
            assert!(
                r.is_err(),
                "{q} {isa:?}: a 256-value row against 512 activations must be refused"
            );
        }
    }
}

/// The softmax weights of an attention tile on every instruction set (the AVX-512 path is
/// a polynomial exp) against f64's exp: relative error below 4e-7 (libm's `expf` is within
/// about 1e-7) where the result is a normal f32, and below the smallest normal where it
/// underflows; the sum equal to the weights' own sum.
#[test]
fn softmax_weights_match_f64_exp() {
    // A dense sweep of x in [-110, 0] (every 1/64, plus the ends), in tiles of awkward
    // lengths so the masked tails run too.
    let xs: Vec<f32> = (0..=110 * 64)
        .map(|i| -(i as f32) / 64.0)
        .chain([-0.0, -1e-7, -87.3, -103.9])
        .collect();
    for simd in paths()
        .into_iter()
        .map(kiln_backend_cpu::kernels::Simd::detect)
    {
        for tile in xs.chunks(37) {
            let max = 0.0f32;
            let mut w = tile.to_vec();
            let sum = kiln_backend_cpu::kernels::exp_shifted_sum(simd, &mut w, max);
            for (&x, &got) in tile.iter().zip(&w) {
                let want = (x as f64 - max as f64).exp();
                if want >= f32::MIN_POSITIVE as f64 {
                    let rel = (got as f64 - want).abs() / want;
                    assert!(
                        rel < 4e-7,
                        "{simd:?}: e^{x} = {got}, want {want} (rel {rel:e})"
                    );
                } else {
                    assert!(
                        (got as f64 - want).abs() < f32::MIN_POSITIVE as f64,
                        "{simd:?}: e^{x} = {got}, want {want}"
                    );
                }
            }
            let own: f64 = w.iter().map(|&v| v as f64).sum();
            assert!(
                (sum as f64 - own).abs() <= 1e-6 * own.max(1e-30),
                "{simd:?}: sum {sum} of weights summing to {own}"
            );
        }
    }
}
