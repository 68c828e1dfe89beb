//! The element-wise and per-head pieces of a transformer block, in f32.

use kiln_core::RopeKind;

use crate::kernels::{self, Simd};

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

/// GELU (tanh form) as ggml's CPU backend computes it: 0 below −10, the identity above 10,
/// and between them the input rounded to f16 and looked up in a table of f16 results (its
/// `ggml_vec_gelu_f32` / `ggml_vec_geglu_f32` with `GGML_GELU_FP16`, which ggml defines).
pub fn gelu_as_ggml_cpu(x: f32) -> f32 {
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        let x16 = half::f16::from_f32(x).to_f32();
        half::f16::from_f32(kiln_core::ir::gelu_tanh(x16)).to_f32()
    }
}

pub fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
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
/// the start of `keys`/`values`. A paged layer gives one run per block of the sequence
/// (blocks adjacent in the pool merged into one), a ring-buffered layer two when it wraps.
/// Each run is tiled on its own, so the bits of a result depend on where the runs break:
/// a sequence whose blocks lie one after another computes what one contiguous run gives.
pub struct KvRun<'a> {
    pub keys: &'a [f32],
    pub values: &'a [f32],
    pub len: usize,
}

/// One query's online-softmax step over a tile of its scores `s`: rescales the output and
/// the denominator it has so far when the tile raises its maximum, then turns the scores
/// into the tile's weights in place (adding their sum to the denominator).
fn softmax_tile(
    simd: Option<Simd>,
    s: &mut [f32],
    max: &mut f32,
    denom: &mut f32,
    out: &mut [f32],
) {
    let new_max = s.iter().fold(*max, |m, &v| m.max(v));
    let correction = (*max - new_max).exp();
    if correction != 1.0 {
        *denom *= correction;
        for o in out {
            *o *= correction;
        }
    }
    *max = new_max;
    *denom += kernels::exp_shifted_sum(simd, s, new_max);
}

/// Up to [`kernels::MULTI_QUERIES`] query heads of one GQA group (`q`: their `hd` values
/// each, side by side) against the positions in `runs` of their shared KV head, as
/// [`attend`] does for one, with each key and value row read once for all of them; `out`
/// gets their outputs side by side. `sinks` (a logit per query head, or none) join each
/// softmax's denominator with no value (see [`softmax_start`]).
#[allow(clippy::too_many_arguments)]
pub fn attend_group(
    simd: Option<Simd>,
    q: &[f32],
    hd: usize,
    runs: &[KvRun<'_>],
    stride: usize,
    offset: usize,
    scale: f32,
    sinks: Option<&[f32]>,
    out: &mut [f32],
) {
    const MQ: usize = kernels::MULTI_QUERIES;
    let heads = q.len().checked_div(hd).unwrap_or(0);
    assert!(
        (1..=MQ).contains(&heads) && q.len() == heads * hd && out.len() == heads * hd,
        "attend_group: {heads} heads of {hd} for {} query and {} output values",
        q.len(),
        out.len()
    );
    let mut scores = [0.0f32; MQ * TILE];
    let mut max = [f32::NEG_INFINITY; MQ];
    let mut denom = [0.0f32; MQ];
    softmax_start(sinks, &mut max[..heads], &mut denom[..heads]);
    out.fill(0.0);
    for run in runs {
        let (keys, values, len) = (run.keys, run.values, run.len);
        for start in (0..len).step_by(TILE) {
            let n = (len - start).min(TILE);
            let rows = start * stride + offset;
            let tile = &mut scores[..heads * n];
            kernels::scores_multi_f32(simd, q, hd, &keys[rows..], stride, scale, n, tile);
            for k in 0..heads {
                let o = &mut out[k * hd..(k + 1) * hd];
                softmax_tile(
                    simd,
                    &mut tile[k * n..(k + 1) * n],
                    &mut max[k],
                    &mut denom[k],
                    o,
                );
            }
            kernels::weighted_rows_multi_f32(simd, tile, n, &values[rows..], stride, hd, out);
        }
    }
    for (o, d) in out.chunks_exact_mut(hd).zip(denom) {
        let inv = 1.0 / d;
        for v in o {
            *v *= inv;
        }
    }
}

/// The online softmax's state before the first tile: nothing seen, or each query's sink
/// logit seen as a key whose value is zero (maximum the sink, denominator e⁰ = 1), which is
/// the softmax over the scores and the sink with the sink's share dropped.
fn softmax_start(sinks: Option<&[f32]>, max: &mut [f32], denom: &mut [f32]) {
    if let Some(sinks) = sinks {
        assert_eq!(sinks.len(), max.len(), "a sink logit per query");
        max.copy_from_slice(sinks);
        denom.fill(1.0);
    }
}

/// Queries of consecutive tokens of one sequence (`q`: `lens.len()` vectors of `hd`
/// values side by side) against one KV head's rows from position 0, query k seeing rows
/// `0..lens[k]` (a causal prefill: each token its own position and those before it). The
/// rows come as `runs` in position order (a paged cache's blocks: see [`KvRun`]), tiled
/// within each run as [`attend_group`] tiles them. Each tile of keys and values is read
/// once for all the queries, where one [`attend_group`] per token streams the whole prefix
/// from memory again for every token. Every query's result has the bits [`attend_group`]
/// gives it alone over the same runs: the tiles are the same, and the rows a query does
/// not see weigh exactly 0 in the tiles it shares with later tokens. `sinks`: a logit per
/// query, as [`attend_group`] takes them.
#[allow(clippy::too_many_arguments)]
pub fn attend_causal(
    simd: Option<Simd>,
    q: &[f32],
    hd: usize,
    lens: &[usize],
    runs: &[KvRun<'_>],
    stride: usize,
    offset: usize,
    scale: f32,
    sinks: Option<&[f32]>,
    out: &mut [f32],
) {
    const MQ: usize = kernels::MULTI_QUERIES;
    let nq = lens.len();
    let len = lens.iter().copied().max().unwrap_or(0);
    assert!(
        q.len() == nq * hd
            && out.len() == nq * hd
            && lens.iter().all(|&l| l >= 1)
            && runs.iter().map(|r| r.len).sum::<usize>() >= len
            && runs.iter().all(|r| r.len == 0
                || (r.len - 1) * stride + offset + hd <= r.keys.len().min(r.values.len())),
        "attend_causal: {nq} queries of {hd} over {len} rows of stride {stride} at {offset} in {} runs, \
         {} query and {} output values",
        runs.len(),
        q.len(),
        out.len(),
    );
    let mut scores = [0.0f32; MQ * TILE];
    let mut max = vec![f32::NEG_INFINITY; nq];
    let mut denom = vec![0.0f32; nq];
    softmax_start(sinks, &mut max, &mut denom);
    out.fill(0.0);
    // Position of the run's first row.
    let mut first = 0;
    for run in runs {
        if first >= len {
            break;
        }
        let run_len = run.len.min(len - first);
        for start in (0..run_len).step_by(TILE) {
            let n = (run_len - start).min(TILE);
            let rows = start * stride + offset;
            for c0 in (0..nq).step_by(MQ) {
                let cq = (nq - c0).min(MQ);
                let tile = &mut scores[..cq * n];
                let (qc, oc) = (
                    &q[c0 * hd..(c0 + cq) * hd],
                    &mut out[c0 * hd..(c0 + cq) * hd],
                );
                kernels::scores_multi_f32(simd, qc, hd, &run.keys[rows..], stride, scale, n, tile);
                for k in 0..cq {
                    let s = &mut tile[k * n..(k + 1) * n];
                    // Rows past this query's own position weigh e^-inf = 0 (the first tile
                    // holds row 0, which every query sees, so its maximum is finite from the
                    // start).
                    let visible = lens[c0 + k].saturating_sub(first + start).min(n);
                    s[visible..].fill(f32::NEG_INFINITY);
                    let o = &mut oc[k * hd..(k + 1) * hd];
                    softmax_tile(simd, s, &mut max[c0 + k], &mut denom[c0 + k], o);
                }
                kernels::weighted_rows_multi_f32(
                    simd,
                    tile,
                    n,
                    &run.values[rows..],
                    stride,
                    hd,
                    oc,
                );
            }
        }
        first += run.len;
    }
    for (o, d) in out.chunks_exact_mut(hd).zip(denom) {
        let inv = 1.0 / d;
        for v in o {
            *v *= inv;
        }
    }
}

/// One query head against the positions in `runs` of its KV head, streaming softmax
/// (running max and sum), so no buffer the size of the context is needed. The head's part
/// of each row starts at `offset`. The order of the rows does not matter (keys carry their
/// position through RoPE). [`attend_group`] with a group of one.
pub fn attend(
    simd: Option<Simd>,
    q: &[f32],
    runs: &[KvRun<'_>],
    stride: usize,
    offset: usize,
    scale: f32,
    out: &mut [f32],
) {
    attend_group(simd, q, q.len(), runs, stride, offset, scale, None, out);
}
