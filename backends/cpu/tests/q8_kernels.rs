//! The integer kernels on 8-bit activations (`kernels::q8`, the opt-in fast path) against
//! kiln-core's reference dequantiser and an f64 dot with the activation as the kernels see
//! it (`d·q` per value), on fresh random blocks; and the activation quantiser itself, bit
//! for bit against ggml's (`fixtures/q8_activations.json`, made by
//! `scripts/fixtures/make_q8_activation_fixture.sh` from a llama.cpp CPU build).

mod common;

use common::{random_bytes, random_vec};
use half::f16;
use kiln_backend_cpu::kernels::q8::{Q8Act, Q8Kernel, ScaleSpan, Q8_TYPES};
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
    let span = Q8Kernel::new(q, Isa::Portable).unwrap().span();
    let mut act = Q8Act::default();
    act.quantize(x, 1, cols, span);
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

/// The few-token form (a batch's tokens sharing each row's decoded weights): every type,
/// one to four activations, row lengths with and without a tail of blocks past the last
/// eight, against the f64 reference on each token's own quantised activation. Outputs start
/// as NaN, so a row or token left unwritten fails.
#[test]
fn q8_few_token_dots_match_reference_dequantisation() {
    let mut rng = Rng::new(0x5eed_0009);
    for q in Q8_TYPES {
        for cols in row_lengths(q) {
            let rows = 5;
            let bytes = random_bytes(&mut rng, q, rows, cols, 1.0);
            let row_bytes = q.row_bytes(cols).unwrap();
            let span = Q8Kernel::new(q, Isa::Portable).unwrap().span();
            let x = random_vec(&mut rng, 4 * cols, 3.0);
            let mut act = Q8Act::default();
            act.quantize(&x, 4, cols, span);
            let mut w = vec![0.0f32; cols];
            let mut expect = vec![[0.0f64; 4]; rows];
            let mut magnitude = vec![[0.0f64; 4]; rows];
            for r in 0..rows {
                dequantize(q, &bytes[r * row_bytes..(r + 1) * row_bytes], &mut w).unwrap();
                for t in 0..4 {
                    let a = act.token(t);
                    let terms = (0..cols).map(|i| w[i] as f64 * a.value(i) as f64);
                    expect[r][t] = terms.clone().sum::<f64>();
                    magnitude[r][t] = terms.map(f64::abs).sum::<f64>();
                }
            }
            for isa in paths() {
                let kernel = Q8Kernel::new(q, isa).unwrap();
                for tokens in 1..=4 {
                    let xs: Vec<_> = (0..tokens).map(|t| act.token(t)).collect();
                    let mut out = vec![vec![f32::NAN; rows]; tokens];
                    let mut outs: Vec<&mut [f32]> =
                        out.iter_mut().map(|o| o.as_mut_slice()).collect();
                    kernel.dot_rows_tokens(&bytes, row_bytes, &xs, &mut outs);
                    for r in 0..rows {
                        for t in 0..tokens {
                            let err = (out[t][r] as f64 - expect[r][t]).abs();
                            assert!(
                                err <= 2e-6 * magnitude[r][t] + 1e-6,
                                "{q} cols {cols} on {} with {tokens} tokens: row {r} token {t} got {} want {} (err {err:e})",
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
                // Code 0x7 / 0xF is ±6 (±12 doubled), MXFP4's largest.
                QType::MXFP4 => 1..17,
                QType::IQ4_NL => 2..18,
                QType::IQ4_XS => 8..136,
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

/// Each value's quant is its value over the scale rounded (so within half a step of it),
/// each 32 values' sum `s` is its scale times their quants' sum, and the scale is the
/// group's largest magnitude over 127 (stored in f16 for 32-value groups), for both spans.
#[test]
fn activation_quantisation_is_within_half_a_step() {
    let mut rng = Rng::new(0x5eed_000a);
    let (tokens, cols) = (3, 512);
    let mut x = random_vec(&mut rng, tokens * cols, 4.0);
    x[5] = 0.0;
    x[cols..cols + 32].fill(0.0); // an all-zero block: scale 0, quants 0
    x[2 * cols + 256..3 * cols].fill(0.0); // an all-zero super-block
    for span in [ScaleSpan::Block, ScaleSpan::SuperBlock] {
        let group = span.values();
        let mut act = Q8Act::default();
        act.quantize(&x, tokens, cols, span);
        assert_eq!(act.tokens(), tokens);
        for t in 0..tokens {
            let a = act.token(t);
            for g in 0..cols / group {
                let xs = &x[t * cols + group * g..][..group];
                let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let inv = if amax == 0.0 { 0.0 } else { 127.0 / amax };
                for b in group * g / 32..group * (g + 1) / 32 {
                    let d = match span {
                        ScaleSpan::Block => f16::from_f32(amax / 127.0).to_f32(),
                        ScaleSpan::SuperBlock if amax == 0.0 => 0.0,
                        ScaleSpan::SuperBlock => 1.0 / inv,
                    };
                    assert_eq!(a.d[b], d, "{span:?} token {t} block {b} scale");
                    let qsum: i32 = a.qs[32 * b..][..32].iter().map(|&q| q as i32).sum();
                    assert_eq!(a.s[b], d * qsum as f32, "{span:?} token {t} block {b} sum");
                }
                for (i, &v) in xs.iter().enumerate() {
                    let q = a.qs[group * g + i] as f32;
                    assert!(
                        (q - v * inv).abs() <= 0.5 + 1e-4,
                        "{span:?} token {t} value {}: {v} became quant {q} (1/step {inv})",
                        group * g + i,
                    );
                }
            }
        }
        assert!(act.token(1).qs[..32].iter().all(|&q| q == 0));
        assert!(act.token(2).qs[256..].iter().all(|&q| q == 0));
    }
}

/// A NaN anywhere in a group makes its scale NaN, so every product with it is NaN: a
/// non-finite activation cannot turn into finite logits.
#[test]
fn a_nan_activation_poisons_its_group() {
    let mut x = vec![1.0f32; 512];
    x[300] = f32::NAN;
    for span in [ScaleSpan::Block, ScaleSpan::SuperBlock] {
        let mut act = Q8Act::default();
        act.quantize(&x, 1, 512, span);
        let a = act.token(0);
        assert!(a.d[300 / 32].is_nan(), "{span:?}");
        assert!(a.d[0].is_finite(), "{span:?}: the first group has no NaN");
        let w = vec![0u8; QType::Q8_0.row_bytes(512).unwrap()];
        let mut out = [0.0f32];
        Q8Kernel::new(QType::Q8_0, Isa::best())
            .unwrap()
            .dot_rows(&w, w.len(), a, &mut out);
        assert!(
            out[0].is_nan(),
            "{span:?}: a zero row times a NaN activation gave {}",
            out[0]
        );
    }
}

fn hex_bytes(v: &serde_json::Value) -> Vec<u8> {
    let s = v.as_str().expect("a hex string");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

/// kiln's two activation forms against ggml's quantisers on the same rows, bit for bit:
/// the quants, the scale (ggml's Q8_K scale and quants carry the opposite sign when the
/// group's largest magnitude is positive: `d = −max/127`; each product is the same) and
/// the per-32 sums.
#[test]
fn activation_quantisation_matches_ggml() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/q8_activations.json"
    );
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
    let fixture: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    let cols = fixture["cols"].as_u64().unwrap() as usize;
    assert_eq!(fixture["q8_1_block_bytes"], 36);
    assert_eq!(fixture["q8_k_block_bytes"], 292);
    let rows = fixture["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 6);
    for (r, row) in rows.iter().enumerate() {
        let x: Vec<f32> = hex_bytes(&row["x"])
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(x.len(), cols);
        let f16_at = |b: &[u8], i: usize| f16::from_le_bytes([b[i], b[i + 1]]).to_f32();

        let mut act = Q8Act::default();
        act.quantize(&x, 1, cols, ScaleSpan::Block);
        let a = act.token(0);
        for (b, blk) in hex_bytes(&row["q8_1"]).chunks_exact(36).enumerate() {
            assert_eq!(
                a.d[b].to_bits(),
                f16_at(blk, 0).to_bits(),
                "row {r} block {b} d"
            );
            let q: Vec<i8> = blk[4..].iter().map(|&v| v as i8).collect();
            assert_eq!(&a.qs[32 * b..][..32], &q[..], "row {r} block {b} quants");
            // ggml stores the sum in f16; kiln keeps d·Σq in f32 (see `ScaleSpan::Block`).
            let qsum: i32 = q.iter().map(|&v| v as i32).sum();
            assert_eq!(a.s[b], a.d[b] * qsum as f32, "row {r} block {b} s");
            let ggml = f16_at(blk, 2);
            assert!(
                (a.s[b] - ggml).abs() <= ggml.abs() / 1024.0 + 1e-30,
                "row {r} block {b}: s {} against ggml's f16 {ggml}",
                a.s[b]
            );
        }

        act.quantize(&x, 1, cols, ScaleSpan::SuperBlock);
        let a = act.token(0);
        for (g, blk) in hex_bytes(&row["q8_k"]).chunks_exact(292).enumerate() {
            let d = f32::from_le_bytes(blk[..4].try_into().unwrap());
            let sign = if d < 0.0 { -1 } else { 1 };
            let q: Vec<i32> = blk[4..260].iter().map(|&v| sign * v as i8 as i32).collect();
            let bsums: Vec<i32> = blk[260..]
                .chunks_exact(2)
                .map(|b| sign * i16::from_le_bytes([b[0], b[1]]) as i32)
                .collect();
            for b in 0..8 {
                let k = 8 * g + b;
                assert_eq!(
                    a.d[k].to_bits(),
                    d.abs().to_bits(),
                    "row {r} super-block {g} d"
                );
                let got: Vec<i32> = a.qs[32 * k..][..32].iter().map(|&v| v as i32).collect();
                assert_eq!(
                    got,
                    q[32 * b..][..32],
                    "row {r} super-block {g} block {b} quants"
                );
                let sum = (bsums[2 * b] + bsums[2 * b + 1]) as f32;
                assert_eq!(
                    a.s[k],
                    a.d[k] * sum,
                    "row {r} super-block {g} block {b} sum"
                );
            }
        }
    }
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
