//! kiln_core::quant against an independent implementation of ggml's block formats (the
//! `gguf` Python package), through the committed fixture `fixtures/dequant_reference.json`
//! made by `scripts/fixtures/make_dequant_fixture.py`, plus property tests of the quantisers.
//!
//! Exactness: the `gguf` package, like ggml, widens the f16 scales to f32 and does every
//! product in f32 without fused multiply-add, so dequantisation must match it bit for bit.
//! The one allowance is NaN in the plain F16 type: only "is NaN" is compared there, because
//! f16→f32 widening may or may not set the quiet bit (numpy keeps the payload as is, F16C
//! hardware quiets it) and both are correct IEEE conversions. Quantiser bytes must match
//! exactly too: both follow ggml's reference (`trunc(x·id + 0.5)`, `roundf`, ties-to-even
//! f16 rounding) with the same f32 operations.
//!
//! Kiln's own types (not ggml's, e.g. APR's Q4) have no `gguf`-package reference: the
//! fixture tests say so per type ("skipped: ...") rather than pass silently. APR Q4 is
//! still checked against the fixture's Q4_0 cases through the lossless nibble permutation
//! between the two layouts.

use kiln_core::quant::{self, can_quantize};
use kiln_core::{Error, QType};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;

fn fixture() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/dequant_reference.json"
    );
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
    serde_json::from_str(&text).expect("fixture is valid JSON")
}

fn unhex(s: &str) -> Vec<u8> {
    assert!(s.len().is_multiple_of(2), "odd-length hex");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex digit"))
        .collect()
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn case_qtype(case: &Value) -> QType {
    let name = case["type"].as_str().expect("type name");
    let qtype = QType::from_name(name).unwrap_or_else(|| panic!("unknown type {name}"));
    assert!(
        qtype.is_ggml(),
        "{name}: the gguf package only knows ggml types"
    );
    assert_eq!(
        u64::from(qtype.ggml_id()),
        case["ggml_id"].as_u64().unwrap(),
        "{name}: ggml id"
    );
    qtype
}

#[test]
fn dequantize_matches_gguf_bit_for_bit() {
    let fx = fixture();
    let cases = fx["dequantize"].as_array().expect("dequantize cases");
    let mut seen = Vec::new();
    for case in cases {
        let qtype = case_qtype(case);
        seen.push(qtype);
        let bytes = unhex(case["bytes_hex"].as_str().unwrap());
        let expected = f32s(&unhex(case["values_f32_le_hex"].as_str().unwrap()));
        assert_eq!(expected.len() as u64, case["n_values"].as_u64().unwrap());

        let mut got = vec![0.0f32; expected.len()];
        quant::dequantize(qtype, &bytes, &mut got).unwrap_or_else(|e| panic!("{qtype}: {e}"));

        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
            let same =
                g.to_bits() == e.to_bits() || (qtype == QType::F16 && g.is_nan() && e.is_nan());
            assert!(
                same,
                "{qtype}: value {i} (block {}, index {}): got {g:e} ({:#010x}), gguf says {e:e} ({:#010x})",
                i / qtype.block_len(),
                i % qtype.block_len(),
                g.to_bits(),
                e.to_bits()
            );
        }
    }
    // A regenerated fixture must not silently drop a type.
    for q in [
        QType::F32,
        QType::F16,
        QType::BF16,
        QType::Q4_0,
        QType::Q4_1,
        QType::Q5_0,
        QType::Q5_1,
        QType::Q8_0,
        QType::Q2_K,
        QType::Q3_K,
        QType::Q4_K,
        QType::Q5_K,
        QType::Q6_K,
        QType::MXFP4,
        QType::IQ4_NL,
        QType::IQ4_XS,
        QType::IQ2_XXS,
        QType::IQ2_XS,
        QType::IQ2_S,
        QType::IQ3_XXS,
        QType::IQ3_S,
        QType::IQ1_S,
        QType::IQ1_M,
    ] {
        assert!(seen.contains(&q), "fixture has no {q} case");
    }
    report_types_without_reference(&seen);
}

/// Kiln's own types cannot be in a fixture made by the `gguf` package; say so for each
/// rather than let the fixture tests look as if they had covered them.
fn report_types_without_reference(seen: &[QType]) {
    for q in QType::ALL.into_iter().filter(|q| !q.is_ggml()) {
        assert!(!seen.contains(&q));
        println!("skipped: no gguf-package reference for {q}");
    }
}

/// APR Q4 holds the same fields as Q4_0 with the nibbles in another order, so every Q4_0
/// block of the fixture, permuted, must dequantise as APR Q4 to gguf's Q4_0 values bit for
/// bit (and the permutation must be lossless).
#[test]
fn apr_q4_matches_gguf_q4_0_through_the_nibble_permutation() {
    let fx = fixture();
    let mut blocks = 0;
    for case in fx["dequantize"].as_array().unwrap() {
        if case_qtype(case) != QType::Q4_0 {
            continue;
        }
        let bytes = unhex(case["bytes_hex"].as_str().unwrap());
        let expected = f32s(&unhex(case["values_f32_le_hex"].as_str().unwrap()));
        let apr: Vec<u8> = bytes
            .chunks_exact(18)
            .flat_map(|b| quant::q4_0_block_to_apr_q4(b.try_into().unwrap()))
            .collect();
        for (a, b) in apr.chunks_exact(18).zip(bytes.chunks_exact(18)) {
            assert_eq!(
                &quant::apr_q4_block_to_q4_0(a.try_into().unwrap())[..],
                b,
                "permutation is not lossless"
            );
        }
        let mut got = vec![0.0f32; expected.len()];
        quant::dequantize(QType::AprQ4, &apr, &mut got).unwrap();
        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
            assert_eq!(
                g.to_bits(),
                e.to_bits(),
                "value {i}: apr_q4 {g:e}, gguf q4_0 {e:e}"
            );
        }
        blocks += apr.len() / 18;
    }
    assert!(blocks > 0, "fixture has no q4_0 blocks");
}

fn fixture_rows(fx: &Value) -> Vec<f32> {
    f32s(&unhex(
        fx["quantize"]["values_f32_le_hex"].as_str().unwrap(),
    ))
}

#[test]
fn quantizers_match_gguf_bytes() {
    let fx = fixture();
    let rows = fixture_rows(&fx);
    let cases = fx["quantize"]["cases"].as_array().expect("quantize cases");
    let mut seen = Vec::new();
    for case in cases {
        let qtype = case_qtype(case);
        seen.push(qtype);
        let expected = unhex(case["bytes_hex"].as_str().unwrap());
        let mut got = vec![0u8; qtype.row_bytes(rows.len()).unwrap()];
        quant::quantize(qtype, &rows, &mut got).unwrap_or_else(|e| panic!("{qtype}: {e}"));
        assert_eq!(got.len(), expected.len(), "{qtype}: byte count");
        let bb = qtype.block_bytes();
        for (b, (g, e)) in got.chunks(bb).zip(expected.chunks(bb)).enumerate() {
            let bl = qtype.block_len();
            assert_eq!(
                g,
                e,
                "{qtype}: block {b} differs; input {:?}",
                &rows[b * bl..(b + 1) * bl]
            );
        }
    }
    for q in [
        QType::Q4_0,
        QType::Q4_1,
        QType::Q5_0,
        QType::Q5_1,
        QType::Q8_0,
    ] {
        assert!(seen.contains(&q), "fixture has no {q} quantise case");
    }
    report_types_without_reference(&seen);
}

/// Q8_1 is Q8_0 plus the f16 sum `s = d·Σq`; gguf has no Q8_1, so it is pinned to the
/// (fixture-checked) Q8_0 quantiser: same `d`, same codes, and `s` the f16 of `Σq·d` where
/// `d` is the f32 scale before rounding.
#[test]
fn q8_1_is_q8_0_plus_the_scaled_sum() {
    let rows = fixture_rows(&fixture());
    let mut q80 = vec![0u8; QType::Q8_0.row_bytes(rows.len()).unwrap()];
    let mut q81 = vec![0u8; QType::Q8_1.row_bytes(rows.len()).unwrap()];
    quant::quantize_row_q8_0(&rows, &mut q80).unwrap();
    quant::quantize_row_q8_1(&rows, &mut q81).unwrap();
    for (b, (a, c)) in q80.chunks_exact(34).zip(q81.chunks_exact(36)).enumerate() {
        assert_eq!(a[0..2], c[0..2], "block {b}: d");
        assert_eq!(a[2..34], c[4..36], "block {b}: codes");
        let d16 = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
        let s = half::f16::from_le_bytes([c[2], c[3]]).to_f32();
        let sum: i32 = c[4..36].iter().map(|&q| i32::from(q as i8)).sum();
        // s rounds Σq·d32 once and d16 is d32 rounded once: each costs at most 2^-11
        // relative, or half an f16 subnormal step (2^-25) absolute in the subnormal range,
        // where the fixture's 1e-6 blocks put d.
        let approx = sum as f32 * d16;
        let tol = (approx.abs() + s.abs()) * 2f32.powi(-10)
            + (sum.unsigned_abs() as f32 + 1.0) * 2f32.powi(-25);
        assert!(
            (s - approx).abs() <= tol,
            "block {b}: s = {s}, Σq·d = {approx}"
        );
    }
    let mut y0 = vec![0.0f32; rows.len()];
    let mut y1 = vec![0.0f32; rows.len()];
    quant::dequantize(QType::Q8_0, &q80, &mut y0).unwrap();
    quant::dequantize(QType::Q8_1, &q81, &mut y1).unwrap();
    assert_eq!(y0, y1, "Q8_1 values are d·q, as Q8_0's");
}

#[test]
fn q8_k_is_f32_scale_times_codes() {
    // d = -0.375 (exact in f32), codes -128..=127, bsums filled with junk: they must not matter.
    let mut block = vec![0u8; 292];
    block[0..4].copy_from_slice(&(-0.375f32).to_le_bytes());
    for (i, q) in block[4..260].iter_mut().enumerate() {
        *q = (i as i32 - 128) as i8 as u8;
    }
    block[260..].fill(0xA5);
    let mut y = vec![0.0f32; 256];
    quant::dequantize(QType::Q8_K, &block, &mut y).unwrap();
    for (i, v) in y.iter().enumerate() {
        assert_eq!(*v, -0.375 * (i as f32 - 128.0), "value {i}");
    }
}

/// A row of 32-value blocks whose per-block magnitude spans 1e-2..1e3 (keeping every scale
/// a normal f16) and whose shapes vary: uniform, one-signed, heavy-tailed, sparse.
fn random_row(rng: &mut StdRng, blocks: usize) -> Vec<f32> {
    let mut row = Vec::with_capacity(blocks * 32);
    for _ in 0..blocks {
        let scale = 10f32.powf(rng.random_range(-2.0..3.0));
        let shape = rng.random_range(0..4);
        for _ in 0..32 {
            let u: f32 = rng.random_range(-1.0..1.0);
            let v = match shape {
                0 => u,
                1 => u.abs() + 0.5,
                2 => u * u * u,
                _ => {
                    if rng.random_bool(0.25) {
                        u
                    } else {
                        0.0
                    }
                }
            };
            row.push(v * scale);
        }
    }
    row
}

/// Largest allowed |x − dequant(quant(x))| for value `x` of a block. `d` is the step the
/// quantiser chose (in f32, before f16 rounding); f16 rounding of the stored scale and
/// min costs 2^-11 relative each, times the largest code it multiplies.
fn error_bound(qtype: QType, x: f32, block: &[f32]) -> f32 {
    const F16_REL: f32 = 1.0 / 2048.0;
    let amax = block.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let min = block.iter().copied().fold(f32::MAX, f32::min);
    let max = block.iter().copied().fold(-f32::MAX, f32::max);
    // f32 rounding in x·id and q·d + m: a few ulps of the block's magnitude.
    let arith = (amax + min.abs()) * 1e-6;
    let bound = match qtype {
        QType::F32 => 0.0,
        // Below 2^-14 f16 is subnormal: a fixed step of 2^-24.
        QType::F16 => x.abs() * F16_REL + 2f32.powi(-25),
        QType::BF16 => x.abs() / 256.0,
        // Symmetric: the extreme maps to -8 (-16) exactly; values on the other side beyond
        // +7.5 (+15.5) steps clamp to +7 (+15) and may be off by up to a whole step.
        QType::Q4_0 | QType::Q5_0 => {
            let levels = if qtype == QType::Q4_0 { 8.0 } else { 16.0 };
            let d = amax / levels;
            let rounding = if x.abs() <= (levels - 0.5) * d {
                0.5
            } else {
                1.0
            };
            d * (rounding + levels * F16_REL)
        }
        QType::Q4_1 | QType::Q5_1 => {
            let top = if qtype == QType::Q4_1 { 15.0 } else { 31.0 };
            let d = (max - min) / top;
            d * (0.5 + top * F16_REL) + min.abs() * F16_REL
        }
        QType::Q8_0 | QType::Q8_1 => {
            let d = amax / 127.0;
            d * (0.5 + 127.0 * F16_REL)
        }
        // aprender's rule: d = amax / 7, so codes stay within ±7 and nothing clamps.
        QType::AprQ4 => {
            let d = amax / 7.0;
            d * (0.5 + 7.0 * F16_REL)
        }
        other => unreachable!("{other} has no quantiser"),
    };
    bound + arith
}

#[test]
fn quantize_dequantize_error_is_bounded() {
    let mut rng = StdRng::seed_from_u64(0x6b696c6e);
    let types = [
        QType::F32,
        QType::F16,
        QType::BF16,
        QType::Q4_0,
        QType::Q4_1,
        QType::Q5_0,
        QType::Q5_1,
        QType::Q8_0,
        QType::Q8_1,
        QType::AprQ4,
    ];
    for round in 0..40 {
        let row = random_row(&mut rng, 1 + round % 7);
        for qtype in types {
            let mut bytes = vec![0u8; qtype.row_bytes(row.len()).unwrap()];
            quant::quantize(qtype, &row, &mut bytes).unwrap();
            let mut back = vec![0.0f32; row.len()];
            quant::dequantize(qtype, &bytes, &mut back).unwrap();
            for (b, (xs, ys)) in row.chunks(32).zip(back.chunks(32)).enumerate() {
                for (i, (&x, &y)) in xs.iter().zip(ys).enumerate() {
                    let bound = error_bound(qtype, x, xs);
                    assert!(
                        (x - y).abs() <= bound,
                        "{qtype}, round {round}, block {b}, value {i}: {x} came back as {y} (bound {bound})"
                    );
                }
            }
        }
    }
}

#[test]
fn sub_step_inputs_round_trip_exactly() {
    // Values already on a Q4_0/Q8_0 grid with a power-of-two step survive unchanged: the
    // quantiser finds the same step and the same codes.
    let q4: Vec<f32> = (0..32)
        .map(|i| ((i * 7) % 16) as f32 - 8.0)
        .map(|v| v * 0.125)
        .collect();
    let q8: Vec<f32> = (0..32)
        .map(|i| (i * 37 % 255) as f32 - 127.0)
        .map(|v| v / 64.0)
        .collect();
    for (qtype, row) in [(QType::Q4_0, q4), (QType::Q8_0, q8)] {
        let mut bytes = vec![0u8; qtype.row_bytes(32).unwrap()];
        quant::quantize(qtype, &row, &mut bytes).unwrap();
        let mut back = vec![0.0f32; 32];
        quant::dequantize(qtype, &bytes, &mut back).unwrap();
        assert_eq!(back, row, "{qtype}");
    }
}

#[test]
fn any_bytes_dequantize_without_panicking() {
    let mut rng = StdRng::seed_from_u64(7);
    for qtype in QType::ALL {
        for _ in 0..20 {
            let n = qtype.block_len() * rng.random_range(0..4);
            let mut bytes = vec![0u8; qtype.row_bytes(n).unwrap()];
            rng.fill(&mut bytes[..]);
            let mut out = vec![0.0f32; n];
            quant::dequantize(qtype, &bytes, &mut out).unwrap_or_else(|e| panic!("{qtype}: {e}"));
        }
    }
}

fn is_invalid_shape<T: std::fmt::Debug>(r: Result<T, Error>) -> bool {
    matches!(r, Err(Error::InvalidShape(_)))
}

#[test]
fn wrong_lengths_are_invalid_shape_errors() {
    for qtype in QType::ALL {
        let bl = qtype.block_len();
        let n = 2 * bl;
        let good = qtype.row_bytes(n).unwrap();

        let mut out = vec![0.0f32; n];
        assert!(
            is_invalid_shape(quant::dequantize(qtype, &vec![0; good - 1], &mut out)),
            "{qtype}: short src"
        );
        assert!(
            is_invalid_shape(quant::dequantize(qtype, &vec![0; good + 1], &mut out)),
            "{qtype}: long src"
        );
        if bl > 1 {
            let mut ragged = vec![0.0f32; n + 1];
            assert!(
                is_invalid_shape(quant::dequantize(qtype, &vec![0; good], &mut ragged)),
                "{qtype}: partial block"
            );
        }
        assert!(
            quant::dequantize(qtype, &[], &mut []).is_ok(),
            "{qtype}: an empty row is zero blocks"
        );

        let src = vec![0.5f32; n];
        if can_quantize(qtype) {
            assert!(
                is_invalid_shape(quant::quantize(qtype, &src, &mut vec![0; good - 1])),
                "{qtype}: short dst"
            );
            assert!(
                is_invalid_shape(quant::quantize(qtype, &src, &mut vec![0; good + 1])),
                "{qtype}: long dst"
            );
            if bl > 1 {
                let ragged = vec![0.5f32; n - 1];
                let bytes = qtype.block_bytes() * 2;
                assert!(
                    is_invalid_shape(quant::quantize(qtype, &ragged, &mut vec![0; bytes])),
                    "{qtype}: partial block"
                );
            }
        } else {
            assert!(
                matches!(
                    quant::quantize(qtype, &src, &mut vec![0; good]),
                    Err(Error::Unsupported(_))
                ),
                "{qtype}: K-quant quantisers are not provided"
            );
        }
    }
}
