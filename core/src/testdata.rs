//! Random but valid data for tests, benchmarks and the conformance suite: uniform vectors,
//! and weights drawn Gaussian and quantised by the reference quantisers (shaped like a
//! trained model's after `kiln quantize`: zero-mean sub-blocks, realistic scales). Every
//! draw comes from a seeded [`Rng`], so a failure can be replayed from its seed.

use crate::error::Result;
use crate::qtype::QType;
use crate::sampling::Rng;

/// Uniform in [lo, hi).
pub fn uniform(rng: &mut Rng, lo: f32, hi: f32) -> f32 {
    lo + (hi - lo) * rng.next_f32()
}

/// `n` values uniform in [-scale, scale).
pub fn random_vec(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| uniform(rng, -scale, scale)).collect()
}

/// `rows` rows of `row_len` values drawn from N(0, std²) (Box–Muller) and quantised to
/// `qtype` by [`crate::quant::quantize`]. Fails for a row length that is not a whole number
/// of `qtype`'s blocks and for types the reference cannot quantise to.
pub fn gaussian_weights(
    rng: &mut Rng,
    qtype: QType,
    row_len: usize,
    rows: usize,
    std: f32,
) -> Result<Vec<u8>> {
    let rb = qtype.row_bytes(row_len)?;
    let mut out = vec![0u8; rb * rows];
    let mut row = vec![0f32; row_len];
    for dst in out.chunks_exact_mut(rb) {
        for v in row.iter_mut() {
            let u1 = rng.next_f32().max(1e-7);
            let u2 = rng.next_f32();
            *v = std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos();
        }
        crate::quant::quantize(qtype, &row, dst)?;
    }
    Ok(out)
}

/// A seed that differs per run (printed by the tests so a failure can be replayed), or the
/// one in `KILN_TEST_SEED` when that is set: run the failing test alone with the seed it
/// printed to draw the same inputs again.
pub fn fresh_seed() -> u64 {
    if let Some(seed) = std::env::var("KILN_TEST_SEED")
        .ok()
        .and_then(|s| s.trim().parse().ok())
    {
        return seed;
    }
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    (t as u64) ^ ((std::process::id() as u64) << 32)
}
