//! Quality of kiln's quantisers on random normal rows: each type's round-trip error, and
//! Q4_K's scale/min search against an exhaustive per-sub-block search.

use half::f16;
use kiln_core::quant::{dequantize, kquants::scale_min_k4, quantize};
use kiln_core::QType;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn normal_rows(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            // Box–Muller from two uniforms.
            let u1: f32 = 1.0 - rng.random::<f32>();
            let u2: f32 = rng.random();
            (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
        })
        .collect()
}

fn rel_rmse(x: &[f32], y: &[f32]) -> f64 {
    let (mut e, mut r) = (0.0f64, 0.0f64);
    for (&a, &b) in x.iter().zip(y) {
        e += f64::from(a - b).powi(2);
        r += f64::from(a).powi(2);
    }
    (e / r).sqrt()
}

fn round_trip(qtype: QType, x: &[f32]) -> Vec<f32> {
    let mut q = vec![0u8; qtype.row_bytes(x.len()).unwrap()];
    quantize(qtype, x, &mut q).unwrap();
    let mut y = vec![0.0f32; x.len()];
    dequantize(qtype, &q, &mut y).unwrap();
    y
}

#[test]
fn every_type_round_trips_within_its_expected_error() {
    let x = normal_rows(256 * 512, 1);
    // Upper bounds ~5% above what each format achieves on N(0, 1) data: a broken
    // search or packing overshoots them by far more.
    let cases = [
        (QType::F16, 0.00025),
        (QType::Q8_0, 0.0056),
        (QType::Q6_K, 0.0186),
        (QType::Q5_1, 0.0400),
        (QType::Q5_0, 0.0450),
        (QType::Q5_K, 0.0380),
        (QType::Q4_1, 0.0820),
        (QType::Q4_0, 0.0900),
        (QType::Q4_K, 0.0750),
    ];
    let mut errors = Vec::new();
    for (qtype, bound) in cases {
        let e = rel_rmse(&x, &round_trip(qtype, &x));
        println!("{qtype:>5}: relative RMSE {e:.5} (bound {bound})");
        errors.push((qtype, e, bound));
    }
    for &(qtype, e, bound) in &errors {
        assert!(e < bound, "{qtype}: relative RMSE {e} exceeds {bound}");
    }
    let err = |q: QType| errors.iter().find(|(t, _, _)| *t == q).unwrap().1;
    // The K-quants beat the 32-value types of the same bit width.
    assert!(err(QType::Q4_K) < err(QType::Q4_1));
    assert!(err(QType::Q5_K) < err(QType::Q5_1));
    assert!(err(QType::Q6_K) < err(QType::Q5_K));
}

#[test]
fn kquants_survive_degenerate_blocks() {
    for qtype in [QType::Q4_K, QType::Q5_K, QType::Q6_K] {
        let zeros = vec![0.0f32; 512];
        assert!(
            round_trip(qtype, &zeros).iter().all(|&v| v == 0.0),
            "{qtype}: zeros"
        );
        // A constant positive block: representable exactly through the scale alone (the
        // min is clamped to 0), up to f16 and 6-bit scale rounding.
        let ones = vec![1.5f32; 256];
        let y = round_trip(qtype, &ones);
        assert!(
            rel_rmse(&ones, &y) < 0.01,
            "{qtype}: constant block decodes to {:?}",
            &y[..4]
        );
        // All-negative values (Q6_K's largest scale is negative; Q4_K/Q5_K need the min).
        let neg: Vec<f32> = normal_rows(256, 9).iter().map(|v| -v.abs() - 0.5).collect();
        let bound = if qtype == QType::Q4_K { 0.06 } else { 0.03 };
        assert!(
            rel_rmse(&neg, &round_trip(qtype, &neg)) < bound,
            "{qtype}: negative block"
        );
        // One huge outlier among small values must not produce NaN or infinities.
        let mut spike = normal_rows(256, 10);
        spike[17] = 3.0e4;
        assert!(
            round_trip(qtype, &spike).iter().all(|v| v.is_finite()),
            "{qtype}: outlier"
        );
    }
}

/// The best `(scale, offset)` for 32 values with 4-bit codes, found by brute force: every
/// pair on a fine grid of offsets in `[min(x), 0]` and scales around `range / 15` rounds the
/// codes, then the least-squares `(scale, offset)` for those codes (offset kept ≤ 0) is
/// scored by plain squared error.
fn exhaustive_sub_block(x: &[f32]) -> (f32, f32) {
    let min = x.iter().copied().fold(f32::INFINITY, f32::min).min(0.0);
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let range = max - min;
    if range <= 0.0 {
        return (0.0, min);
    }
    let mut best = (f32::INFINITY, 0.0f32, 0.0f32);
    const STEPS: usize = 48;
    for a in 0..=STEPS {
        let offset = min * (1.0 - 0.5 * a as f32 / STEPS as f32); // min .. min/2
        for b in 0..=STEPS {
            let scale = range / 15.0 * (0.75 + 0.5 * b as f32 / STEPS as f32);
            let codes: Vec<f32> = x
                .iter()
                .map(|&v| ((v - offset) / scale).round().clamp(0.0, 15.0))
                .collect();
            let n = x.len() as f64;
            let (sl, sl2, sx, sxl) =
                codes
                    .iter()
                    .zip(x)
                    .fold((0.0f64, 0.0f64, 0.0f64, 0.0f64), |acc, (&l, &v)| {
                        let (l, v) = (f64::from(l), f64::from(v));
                        (acc.0 + l, acc.1 + l * l, acc.2 + v, acc.3 + v * l)
                    });
            let det = n * sl2 - sl * sl;
            if det <= 0.0 {
                continue;
            }
            let mut s = (n * sxl - sx * sl) / det;
            let mut m = (sl2 * sx - sl * sxl) / det;
            if m > 0.0 {
                m = 0.0;
                s = sxl / sl2;
            }
            let err: f64 = codes
                .iter()
                .zip(x)
                .map(|(&l, &v)| (s * f64::from(l) + m - f64::from(v)).powi(2))
                .sum();
            if (err as f32) < best.0 {
                best = (err as f32, s as f32, m as f32);
            }
        }
    }
    (best.1, best.2)
}

/// Q4_K encoding of one super-block with the exhaustive sub-block search, then the same
/// 6-bit scale quantisation, f16 super-scales and re-rounding as the format requires.
fn exhaustive_q4_k(x: &[f32]) -> Vec<f32> {
    let subs: Vec<(f32, f32)> = x.chunks(32).map(exhaustive_sub_block).collect();
    let max_scale = subs.iter().map(|s| s.0).fold(0.0, f32::max);
    let max_min = subs.iter().map(|s| -s.1).fold(0.0, f32::max);
    let d = f16::from_f32(max_scale / 63.0).to_f32();
    let dmin = f16::from_f32(max_min / 63.0).to_f32();
    let mut y = Vec::with_capacity(x.len());
    for (chunk, &(s, m)) in x.chunks(32).zip(&subs) {
        let ls = if max_scale > 0.0 {
            (63.0 * s / max_scale).round().min(63.0)
        } else {
            0.0
        };
        let lm = if max_min > 0.0 {
            (63.0 * -m / max_min).round().min(63.0)
        } else {
            0.0
        };
        let (sd, md) = (d * ls, dmin * lm);
        for &v in chunk {
            let q = if sd > 0.0 {
                ((v + md) / sd).round().clamp(0.0, 15.0)
            } else {
                0.0
            };
            y.push(sd * q - md);
        }
    }
    y
}

#[test]
fn q4_k_search_is_within_2_percent_of_exhaustive() {
    let x = normal_rows(256 * 256, 7);
    let kiln = rel_rmse(&x, &round_trip(QType::Q4_K, &x));
    let exhaustive_y: Vec<f32> = x.chunks(256).flat_map(exhaustive_q4_k).collect();
    let exhaustive = rel_rmse(&x, &exhaustive_y);
    let ratio = kiln / exhaustive;
    println!("Q4_K relative RMSE: kiln {kiln:.5}, exhaustive per-sub-block search {exhaustive:.5}, ratio {ratio:.4}");
    assert!(
        ratio <= 1.02,
        "kiln's Q4_K search is {ratio:.4}× the exhaustive search's error"
    );
}

#[test]
fn q4_k_scales_use_the_full_6_bit_range() {
    // The largest sub-block scale maps to 63: the super-block scale is not wasted.
    let x = normal_rows(256, 3);
    let mut q = vec![0u8; 144];
    quantize(QType::Q4_K, &x, &mut q).unwrap();
    let max_sc = (0..8).map(|j| scale_min_k4(&q[4..16], j).0).max().unwrap();
    assert_eq!(max_sc, 63);
}
