//! Random but valid inputs for kernel tests and benchmarks: weights in every GEMV type with
//! sane f16 scales (random bits there could be Inf or NaN), activations, and the f64
//! reference product through `kiln_core::quant::dequantize`.

use half::f16;
use kiln_core::{QType, Rng};

use crate::error::{KernelError, Result};

pub use kiln_core::testdata::{fresh_seed, random_vec, uniform};

fn put_f16(b: &mut [u8], at: usize, v: f32) {
    b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// `rows` rows of `row_len` values of `qtype`, ggml-encoded: random quants, and scales
/// chosen so dequantised values stay within about ±1.
pub fn random_weights(rng: &mut Rng, qtype: QType, row_len: usize, rows: usize) -> Result<Vec<u8>> {
    random_weights_scaled(rng, qtype, row_len, rows, 1.0)
}

/// As [`random_weights`], values scaled by about `scale` (model-like weights: 1/√fan_in).
pub fn random_weights_scaled(
    rng: &mut Rng,
    qtype: QType,
    row_len: usize,
    rows: usize,
    scale: f32,
) -> Result<Vec<u8>> {
    let bytes = qtype
        .row_bytes(row_len)
        .map_err(|e| KernelError::InvalidArgument(e.to_string()))?
        * rows;
    let mut out: Vec<u8> = (0..bytes).map(|_| (rng.next_u64() >> 56) as u8).collect();
    match qtype {
        QType::F32 => {
            for c in out.chunks_exact_mut(4) {
                c.copy_from_slice(&(scale * uniform(rng, -1.0, 1.0)).to_le_bytes());
            }
        }
        QType::F16 => {
            for c in out.chunks_exact_mut(2) {
                put_f16(c, 0, scale * uniform(rng, -1.0, 1.0));
            }
        }
        QType::BF16 => {
            for c in out.chunks_exact_mut(2) {
                let v = half::bf16::from_f32(scale * uniform(rng, -1.0, 1.0));
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        _ => {
            for b in out.chunks_exact_mut(qtype.block_bytes()) {
                match qtype {
                    QType::Q4_0 | QType::Q5_0 | QType::AprQ4 => {
                        put_f16(b, 0, scale * uniform(rng, -0.1, 0.1))
                    }
                    QType::Q8_0 => put_f16(b, 0, scale * uniform(rng, -0.008, 0.008)),
                    QType::Q4_1 | QType::Q5_1 => {
                        put_f16(b, 0, scale * uniform(rng, 0.0, 0.1));
                        put_f16(b, 2, scale * uniform(rng, -1.0, 0.0));
                    }
                    // 6-bit sub-scales up to 63: keep d·63·15 near 1.
                    QType::Q4_K | QType::Q5_K => {
                        put_f16(b, 0, scale * uniform(rng, 0.0, 0.002));
                        put_f16(b, 2, scale * uniform(rng, 0.0, 0.002));
                    }
                    QType::Q6_K => put_f16(b, 208, scale * uniform(rng, -0.0005, 0.0005)),
                    // 4-bit sub-scales and mins of 2-bit codes; 6-bit signed sub-scales of
                    // codes −4..3.
                    QType::Q2_K => {
                        put_f16(b, 80, scale * uniform(rng, 0.0, 0.02));
                        put_f16(b, 82, scale * uniform(rng, 0.0, 0.02));
                    }
                    QType::Q3_K => put_f16(b, 108, scale * uniform(rng, -0.008, 0.008)),
                    // Levels up to ±127; IQ4_XS's sub-block scales up to ±32 on top.
                    QType::IQ4_NL => put_f16(b, 0, scale * uniform(rng, -0.008, 0.008)),
                    QType::IQ4_XS => put_f16(b, 0, scale * uniform(rng, -0.0003, 0.0003)),
                    // Levels up to ±12 (E2M1 doubled) times half of 2^(e − 127): e near
                    // 124 + log2(scale) keeps the largest value near `scale`.
                    QType::MXFP4 => {
                        let e =
                            (124.0 + scale.log2()).round() as i64 + (rng.next_u64() % 3) as i64 - 1;
                        b[0] = e.clamp(0, 254) as u8;
                    }
                    // The grid I-quants: random indices, signs and sub-scales, d such that
                    // the block's root mean square is about `scale` / 2 (as `kiln synth`
                    // makes them).
                    QType::IQ2_XXS
                    | QType::IQ2_XS
                    | QType::IQ2_S
                    | QType::IQ3_XXS
                    | QType::IQ3_S
                    | QType::IQ1_S
                    | QType::IQ1_M => {
                        let rms = 0.5 * scale * uniform(rng, 0.8, 1.2);
                        kiln_core::quant::scale_block_to_rms(qtype, b, rms)
                            .map_err(|e| KernelError::InvalidArgument(e.to_string()))?;
                    }
                    other => {
                        return Err(KernelError::Unsupported(format!("random {other} weights")))
                    }
                }
            }
        }
    }
    Ok(out)
}

/// y = W·x in f64 with W dequantised by the CPU reference.
pub fn reference_gemv(
    qtype: QType,
    row_len: usize,
    rows: usize,
    ggml: &[u8],
    x: &[f32],
) -> Result<Vec<f64>> {
    let rb = qtype
        .row_bytes(row_len)
        .map_err(|e| KernelError::InvalidArgument(e.to_string()))?;
    let mut row = vec![0f32; row_len];
    let mut y = Vec::with_capacity(rows);
    for r in 0..rows {
        kiln_core::quant::dequantize(qtype, &ggml[r * rb..(r + 1) * rb], &mut row)
            .map_err(|e| KernelError::InvalidArgument(e.to_string()))?;
        y.push(row.iter().zip(x).map(|(&w, &v)| w as f64 * v as f64).sum());
    }
    Ok(y)
}

/// ‖a − b‖ / ‖b‖; infinite when `a` holds a NaN (an unwritten, poisoned output).
pub fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let mut num = 0.0;
    let mut den = 0.0;
    for (&x, &y) in a.iter().zip(b) {
        if !x.is_finite() {
            return f64::INFINITY;
        }
        num += (x as f64 - y) * (x as f64 - y);
        den += y * y;
    }
    (num / den.max(1e-300)).sqrt()
}

/// `rows` rows of `row_len` values drawn from N(0, std²) and quantised to `qtype` by the
/// CPU reference quantiser ([`kiln_core::testdata::gaussian_weights`]): weights shaped like
/// a trained model's after `kiln quantize`, unlike the uniform bits of [`random_weights`].
pub fn gaussian_weights(
    rng: &mut Rng,
    qtype: QType,
    row_len: usize,
    rows: usize,
    std: f32,
) -> Result<Vec<u8>> {
    kiln_core::testdata::gaussian_weights(rng, qtype, row_len, rows, std).map_err(|e| match e {
        kiln_core::Error::InvalidShape(m) => KernelError::InvalidArgument(m),
        other => KernelError::Unsupported(other.to_string()),
    })
}

/// Name of the variable that makes a missing GPU a test failure instead of a skip. The GPU
/// suite (scripts/gpu/gpu_suite.sh) sets it, so a broken driver on the GPU machine cannot pass
/// as "skipped".
pub const REQUIRE_GPU_ENV: &str = "KILN_REQUIRE_GPU";

/// Reports that a test cannot run here: on the real stderr (libtest captures `println!`,
/// which would hide the skip in a passing test's output), or as a panic when
/// `KILN_REQUIRE_GPU` is set.
pub fn skip(why: &str) {
    use std::io::Write;
    if std::env::var_os(REQUIRE_GPU_ENV).is_some() {
        panic!("{REQUIRE_GPU_ENV} is set but the test cannot run: {why}");
    }
    let _ = writeln!(std::io::stderr().lock(), "skipped: {why}");
}
