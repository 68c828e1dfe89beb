//! The integer kernels on 8-bit activations (`kernels::q8`, the opt-in fast path) against
//! kiln-core's reference dequantiser and an f64 dot with the activation as the kernels see
//! it (`d·q` per value), on fresh random blocks; and the activation quantiser itself.

mod common;

use common::{random_bytes, random_vec};
use kiln_backend_cpu::kernels::q8::{Q8Act, Q8Kernel, Q8_TYPES};
use kiln_backend_cpu::kernels::Isa;
use kiln_core::{quant::dequantize, QType, Rng};

/// Every instruction set this CPU runs; the q8 kernels come in portable and AVX2 forms.
fn paths() -> Vec<Isa> {
    let isas = Isa::available();
    if !isas.contains(&Isa::Avx2) {
        println!("note: no AVX2/FMA/F16C here; only the portable q8 kernels are tested");
    }
    isas
}

fn row_lengths(q: QType) -> Vec<usize> {
    match q.block_len() {
        32 => vec![32, 96, 256, 288, 576, 1536],
        _ => vec![256, 512, 1536],
    }
}

/// Checks every row of `bytes` (`rows × cols` of `q`) against the f64 reference on every
/// instruction set, the kernels' outputs poisoned with NaN first.
fn assert_q8_dots_match(q: QType, bytes: &[u8], rows: usize, cols: usize, x: &[f32], what: &str) {
    let mut act = Q8Act::default();
    act.quantize(x, 1, cols);
    let a = act.token(0);
    let row_bytes = q.row_bytes(cols).unwrap();
    let mut w = vec![0.0f32; cols];
    let (mut expect, mut magnitude) = (Vec::new(), Vec::new());
    for r in 0..rows {
        dequantize(q, &bytes[r * row_bytes..(r + 1) * row_bytes], &mut w).unwrap();
        let terms = (0..cols).map(|i| w[i] as f64 * a.value(i) as f64);
        expect.push(terms.clone().sum::<f64>());
        magnitude.push(terms.map(f64::abs).sum::<f64>());
    }
    for isa in paths() {
        let kernel = Q8Kernel::new(q, isa).unwrap();
        let mut out = vec![f32::NAN; rows];
        kernel.dot_rows(bytes, row_bytes, a, &mut out);
        for r in 0..rows {
            let err = (out[r] as f64 - expect[r]).abs();
            assert!(
                err <= 2e-6 * magnitude[r] + 1e-6,
                "{q} cols {cols} row {r} on {} ({what}): got {} want {} (err {err:e}, Σ|wx| {})",
                isa.name(),
                out[r],
                expect[r],
                magnitude[r]
            );
        }
    }
}

#[test]
fn q8_dots_match_reference_dequantisation() {
    let mut rng = Rng::new(0x5eed_0008);
    for q in Q8_TYPES {
        for cols in row_lengths(q) {
            let rows = 7;
            let bytes = random_bytes(&mut rng, q, rows, cols, 1.0);
            let x = random_vec(&mut rng, cols, 3.0);
            assert_q8_dots_match(q, &bytes, rows, cols, &x, "random");
        }
    }
}

/// Patterns random bytes make unlikely: every quant at its largest or smallest (the pair
/// sums' extremes, where a saturating instruction would show), the fifth-bit fields of the
/// Q5 types all clear, all set or alternating, and activations at ±their block's largest
/// value (quants of ±127).
#[test]
fn q8_dots_hold_at_the_extremes() {
    let mut rng = Rng::new(0x5eed_0009);
    for q in Q8_TYPES {
        let cols = if q.block_len() == 32 { 576 } else { 512 };
        for fill in [0x00u8, 0xFF, 0x80, 0x7F, 0x55] {
            let rows = 3;
            let mut bytes = random_bytes(&mut rng, q, rows, cols, 1.0);
            // Overwrite the quant fields, keep the scales random_bytes drew.
            let quants = match q {
                QType::Q4_0 => 2..18,
                QType::Q4_1 => 4..20,
                QType::Q5_0 => 2..22,
                QType::Q5_1 => 4..24,
                QType::Q8_0 => 2..34,
                QType::Q4_K => 16..144,
                QType::Q6_K => 0..192,
                _ => unreachable!(),
            };
            for blk in bytes.chunks_exact_mut(q.block_bytes()) {
                blk[quants.clone()].fill(fill);
            }
            let sign = |i: usize| if (i / 3) % 2 == 0 { 1.0 } else { -1.0 };
            let x: Vec<f32> = (0..cols).map(|i| 2.5 * sign(i)).collect();
            assert_q8_dots_match(q, &bytes, rows, cols, &x, &format!("quants {fill:#04x}"));
        }
    }
}

#[test]
fn activation_quantisation_is_within_half_a_step() {
    let mut rng = Rng::new(0x5eed_000a);
    let (tokens, cols) = (3, 96);
    let mut x = random_vec(&mut rng, tokens * cols, 4.0);
    x[5] = 0.0;
    x[cols..cols + 32].fill(0.0); // an all-zero block: scale 0, quants 0
    let mut act = Q8Act::default();
    act.quantize(&x, tokens, cols);
    assert_eq!(act.tokens(), tokens);
    for t in 0..tokens {
        let a = act.token(t);
        for b in 0..cols / 32 {
            let xs = &x[t * cols + 32 * b..][..32];
            let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert_eq!(a.d[b], amax / 127.0, "token {t} block {b} scale");
            let qsum: i32 = a.qs[32 * b..][..32].iter().map(|&q| q as i32).sum();
            assert_eq!(a.s[b], a.d[b] * qsum as f32, "token {t} block {b} sum");
            for (i, &v) in xs.iter().enumerate() {
                let err = (a.value(32 * b + i) - v).abs();
                assert!(
                    err <= a.d[b] * 0.5 * (1.0 + 1e-5),
                    "token {t} value {}: {v} became {} (step {})",
                    32 * b + i,
                    a.value(32 * b + i),
                    a.d[b]
                );
            }
        }
    }
    assert!(act.token(1).qs[..32].iter().all(|&q| q == 0));
}

#[test]
fn only_types_with_integer_kernels_get_one() {
    for q in [
        QType::F32,
        QType::F16,
        QType::BF16,
        QType::Q2_K,
        QType::Q3_K,
        QType::Q5_K,
    ] {
        assert!(
            Q8Kernel::new(q, Isa::best()).is_none(),
            "{q} has no q8 kernel"
        );
    }
    for q in Q8_TYPES {
        assert_eq!(Q8Kernel::new(q, Isa::best()).unwrap().qtype(), q);
    }
}
