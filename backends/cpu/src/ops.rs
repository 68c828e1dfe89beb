//! The element-wise and per-head pieces of a transformer block, in f32.

use kiln_core::RopeKind;

use crate::kernels::{scores_f32, weighted_rows_f32, Simd};

/// `out = x / rms(x) · w`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let scale = 1.0 / (ms + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * scale * g;
    }
}

/// In-place RMSNorm (per-head QK norm).
pub fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let scale = 1.0 / (ms + eps).sqrt();
    for (v, &g) in x.iter_mut().zip(w) {
        *v *= scale * g;
    }
}

/// `out = (x − mean) / std · w + b`.
pub fn layer_norm(x: &[f32], w: &[f32], b: Option<&[f32]>, eps: f32, out: &mut [f32]) {
    let n = x.len() as f32;
    let mean = x.iter().sum::<f32>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    let scale = 1.0 / (var + eps).sqrt();
    for (i, (o, &v)) in out.iter_mut().zip(x).enumerate() {
        *o = (v - mean) * scale * w[i] + b.map_or(0.0, |b| b[i]);
    }
}

pub fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// GELU, tanh approximation (what ggml and `gelu_pytorch_tanh` compute).
pub fn gelu(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh())
}

/// Rotates the first `2·cos.len()` dims of one head by the angles whose cosines and sines
/// are given (one per rotary pair).
pub fn rope(kind: RopeKind, head: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    match kind {
        RopeKind::Norm => {
            for i in 0..half {
                let (a, b) = (head[2 * i], head[2 * i + 1]);
                head[2 * i] = a * cos[i] - b * sin[i];
                head[2 * i + 1] = a * sin[i] + b * cos[i];
            }
        }
        RopeKind::Neox => {
            for i in 0..half {
                let (a, b) = (head[i], head[i + half]);
                head[i] = a * cos[i] - b * sin[i];
                head[i + half] = a * sin[i] + b * cos[i];
            }
        }
    }
}

/// Scores computed per tile of the online softmax.
const TILE: usize = 128;

/// Rows of one KV head's cache that a query attends to: `len` rows of `stride` floats from
/// the start of `keys`/`values` (a ring-buffered layer gives two runs when it wraps).
pub struct KvRun<'a> {
    pub keys: &'a [f32],
    pub values: &'a [f32],
    pub len: usize,
}

/// One query head against the positions in `runs` of its KV head, streaming softmax
/// (running max and sum), so no buffer the size of the context is needed. The head's part
/// of each row starts at `offset`. The order of the rows does not matter (keys carry their
/// position through RoPE).
#[allow(clippy::too_many_arguments)]
pub fn attend(
    simd: Option<Simd>,
    q: &[f32],
    runs: &[KvRun<'_>],
    stride: usize,
    offset: usize,
    scale: f32,
    out: &mut [f32],
) {
    let mut scores = [0.0f32; TILE];
    let mut max = f32::NEG_INFINITY;
    let mut denom = 0.0f32;
    out.fill(0.0);
    let mut weights = [0.0f32; TILE];
    for run in runs {
        let (keys, values, len) = (run.keys, run.values, run.len);
        for start in (0..len).step_by(TILE) {
            let n = (len - start).min(TILE);
            let rows = start * stride + offset;
            scores_f32(simd, q, &keys[rows..], stride, scale, &mut scores[..n]);
            let tile_max = scores[..n].iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
            let new_max = max.max(tile_max);
            let correction = (max - new_max).exp();
            if correction != 1.0 {
                denom *= correction;
                for o in out.iter_mut() {
                    *o *= correction;
                }
            }
            max = new_max;
            for (w, &s) in weights[..n].iter_mut().zip(&scores[..n]) {
                *w = (s - max).exp();
                denom += *w;
            }
            weighted_rows_f32(simd, &weights[..n], &values[rows..], stride, out);
        }
    }
    let inv = 1.0 / denom;
    for o in out.iter_mut() {
        *o *= inv;
    }
}
