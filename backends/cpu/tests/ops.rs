//! RoPE and attention pieces against their textbook definitions.

mod common;

use common::random_vec;
use kiln_backend_cpu::ops::{attend, attend_group, rope, KvRun};
use kiln_core::{Rng, RopeConfig, RopeKind, RopeScaling};

#[test]
fn rope_norm_and_neox_follow_their_definitions() {
    let mut rng = Rng::new(1);
    let (hd, rot) = (16, 12); // partial rotary: the last 4 dims must pass through
    let cfg = |kind| RopeConfig {
        kind,
        theta: 10000.0,
        scaling: RopeScaling::None,
        rotary_dims: rot,
    };
    for kind in [RopeKind::Norm, RopeKind::Neox] {
        for pos in [0usize, 1, 7, 300] {
            let x = random_vec(&mut rng, hd, 1.0);
            let c = cfg(kind);
            let (cos, sin): (Vec<f32>, Vec<f32>) = (0..rot / 2)
                .map(|i| (pos as f32 * c.inv_freq(i, None)).sin_cos())
                .map(|(s, c)| (c, s))
                .unzip();
            let mut got = x.clone();
            rope(kind, &mut got, &cos, &sin);
            let mut want = x.clone();
            for i in 0..rot / 2 {
                let theta = pos as f64 * 10000f64.powf(-2.0 * i as f64 / rot as f64);
                let (a, b) = match kind {
                    RopeKind::Norm => (2 * i, 2 * i + 1),
                    RopeKind::Neox => (i, i + rot / 2),
                };
                let (x0, x1) = (x[a] as f64, x[b] as f64);
                want[a] = (x0 * theta.cos() - x1 * theta.sin()) as f32;
                want[b] = (x0 * theta.sin() + x1 * theta.cos()) as f32;
            }
            for d in 0..hd {
                assert!(
                    (got[d] - want[d]).abs() < 1e-4,
                    "{kind:?} pos {pos} dim {d}: {} vs {}",
                    got[d],
                    want[d]
                );
            }
            assert_eq!(
                &got[rot..],
                &x[rot..],
                "dims past rotary_dims are untouched"
            );
        }
    }
    // The two layouts really differ (a swapped implementation would pass neither test above,
    // but make the distinction explicit).
    let x: Vec<f32> = (0..8).map(|i| i as f32).collect();
    let (cos, sin) = (vec![0.0f32; 4], vec![1.0f32; 4]);
    let (mut a, mut b) = (x.clone(), x.clone());
    rope(RopeKind::Norm, &mut a, &cos, &sin);
    rope(RopeKind::Neox, &mut b, &cos, &sin);
    assert_eq!(a, [-1.0, 0.0, -3.0, 2.0, -5.0, 4.0, -7.0, 6.0]);
    assert_eq!(b, [-4.0, -5.0, -6.0, -7.0, 0.0, 1.0, 2.0, 3.0]);
}

#[test]
fn rope_frequency_factors_and_linear_scaling_divide_the_frequency() {
    let c = RopeConfig {
        kind: RopeKind::Norm,
        theta: 500000.0,
        scaling: RopeScaling::Linear { factor: 4.0 },
        rotary_dims: 64,
    };
    let factors: Vec<f32> = (0..32).map(|i| 1.0 + i as f32).collect();
    for i in [0, 5, 31] {
        let plain = 500000f32.powf(-2.0 * i as f32 / 64.0);
        let got = c.inv_freq(i, Some(&factors));
        assert!((got - plain / 4.0 / factors[i]).abs() <= 1e-6 * plain);
    }
}

/// Every head against an f64 softmax, without sink logits and with them (gpt-oss: a logit
/// per head in the denominator, with no value).
#[test]
fn streaming_attention_equals_full_softmax() {
    let mut rng = Rng::new(2);
    let kv_heads = 3;
    // Head sizes with a partial 16-value vector (24, 136), whole ones (32, 64: the
    // kernels specialised for them), and more than
    // the four vectors the AVX-512 weighted sum keeps in registers at a time (80, 136).
    // Lengths around the tile size exercise the running-max rescale.
    for (hd, len) in [24usize, 32, 64, 80, 136]
        .into_iter()
        .flat_map(|hd| [1usize, 5, 127, 128, 129, 300].map(|len| (hd, len)))
    {
        let stride = hd * kv_heads;
        let keys = random_vec(&mut rng, len * stride, 3.0);
        let values = random_vec(&mut rng, len * stride, 1.0);
        let scale = 1.0 / (hd as f32).sqrt();
        // Groups of one to four query heads sharing KV head g (attend_group; attend is the
        // group of one), each against its own f64 reference.
        for (g, heads, with_sinks) in (0..kv_heads)
            .flat_map(|g| (1..=4).map(move |h| (g, h)))
            .flat_map(|(g, h)| [(g, h, false), (g, h, true)])
        {
            let q = random_vec(&mut rng, heads * hd, 3.0);
            let off = g * hd;
            let sinks = with_sinks.then(|| random_vec(&mut rng, heads, 4.0));
            let sinks = sinks.as_deref();
            let want: Vec<Vec<f64>> = (0..heads)
                .map(|k| {
                    let qk = &q[k * hd..(k + 1) * hd];
                    let scores: Vec<f64> = (0..len)
                        .map(|j| {
                            (0..hd)
                                .map(|d| qk[d] as f64 * keys[j * stride + off + d] as f64)
                                .sum::<f64>()
                                * scale as f64
                        })
                        .collect();
                    let sink = sinks.map(|s| s[k] as f64);
                    let max = scores
                        .iter()
                        .cloned()
                        .chain(sink)
                        .fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = scores.iter().chain(&sink).map(|s| (s - max).exp()).sum();
                    (0..hd)
                        .map(|d| {
                            (0..len)
                                .map(|j| {
                                    (scores[j] - max).exp() / z
                                        * values[j * stride + off + d] as f64
                                })
                                .sum()
                        })
                        .collect()
                })
                .collect();
            for simd in kiln_backend_cpu::kernels::Isa::available()
                .into_iter()
                .map(kiln_backend_cpu::kernels::Simd::detect)
            {
                let check = |got: &[f32], what: &str| {
                    for k in 0..heads {
                        for d in 0..hd {
                            let (g_, w) = (got[k * hd + d] as f64, want[k][d]);
                            assert!(
                                (g_ - w).abs() < 1e-5,
                                "len {len} kv head {g}, query {k} of {heads}, dim {d} ({simd:?}, {what}): {g_} vs {w}"
                            );
                        }
                    }
                };
                let mut got = vec![f32::NAN; heads * hd];
                let runs = [KvRun {
                    keys: &keys,
                    values: &values,
                    len,
                }];
                attend_group(simd, &q, hd, &runs, stride, off, scale, sinks, &mut got);
                check(&got, "one run");
                if heads == 1 && sinks.is_none() {
                    got.fill(f32::NAN);
                    attend(simd, &q, &runs, stride, off, scale, &mut got);
                    check(&got, "attend");
                }
                // The same rows as two runs, the later positions first (a wrapped ring).
                let mid = len / 2;
                let runs = [
                    KvRun {
                        keys: &keys[mid * stride..],
                        values: &values[mid * stride..],
                        len: len - mid,
                    },
                    KvRun {
                        keys: &keys[..mid * stride],
                        values: &values[..mid * stride],
                        len: mid,
                    },
                ];
                got.fill(f32::NAN);
                attend_group(simd, &q, hd, &runs, stride, off, scale, sinks, &mut got);
                check(&got, "two runs");
            }
        }
    }
}

/// A causal block of consecutive tokens (attend_causal) gives each query the bits it gets
/// alone (attend_group over its own prefix), on every instruction set: blocks of one to
/// eight tokens of one to four heads, lengths around the tile size, partial vectors.
#[test]
fn causal_blocks_equal_each_token_alone() {
    let mut rng = Rng::new(7);
    let kv_heads = 2;
    for (hd, first) in [24usize, 32, 64, 136]
        .into_iter()
        .flat_map(|hd| [1usize, 100, 126, 127, 128, 250].map(|f| (hd, f)))
    {
        let stride = hd * kv_heads;
        let rows = first + 8;
        let keys = random_vec(&mut rng, rows * stride, 3.0);
        let values = random_vec(&mut rng, rows * stride, 1.0);
        let scale = 1.0 / (hd as f32).sqrt();
        for (tokens, heads) in [(1, 1), (2, 3), (4, 4), (8, 2), (3, 7)] {
            let off = hd;
            let q = random_vec(&mut rng, tokens * heads * hd, 3.0);
            // Token i at position first - 1 + i sees rows 0..first + i.
            let lens: Vec<usize> = (0..tokens)
                .flat_map(|i| std::iter::repeat_n(first + i, heads))
                .collect();
            // Sink logits (a query's own) in every other case.
            let sinks = (tokens % 2 == 0).then(|| random_vec(&mut rng, lens.len(), 4.0));
            let sinks = sinks.as_deref();
            let own_sink = |k: usize| sinks.map(|s| &s[k..k + 1]);
            for simd in kiln_backend_cpu::kernels::Isa::available()
                .into_iter()
                .map(kiln_backend_cpu::kernels::Simd::detect)
            {
                let mut got = vec![f32::NAN; q.len()];
                let whole = [KvRun {
                    keys: &keys,
                    values: &values,
                    len: rows,
                }];
                kiln_backend_cpu::ops::attend_causal(
                    simd, &q, hd, &lens, &whole, stride, off, scale, sinks, &mut got,
                );
                // The same rows as a paged cache's blocks of 32 in the reverse order in
                // memory (as runs): each query gets the bits attend_group gives it over the
                // same runs.
                let (rk, rv) = (
                    blocks_reversed(&keys, stride),
                    blocks_reversed(&values, stride),
                );
                let paged = paged_runs(&rk, &rv, rows, stride);
                let mut got_paged = vec![f32::NAN; q.len()];
                kiln_backend_cpu::ops::attend_causal(
                    simd,
                    &q,
                    hd,
                    &lens,
                    &paged,
                    stride,
                    off,
                    scale,
                    sinks,
                    &mut got_paged,
                );
                for (k, &len) in lens.iter().enumerate() {
                    let mut alone_paged = vec![f32::NAN; hd];
                    attend_group(
                        simd,
                        &q[k * hd..(k + 1) * hd],
                        hd,
                        &paged_runs(&rk, &rv, len, stride),
                        stride,
                        off,
                        scale,
                        own_sink(k),
                        &mut alone_paged,
                    );
                    assert!(
                        got_paged[k * hd..(k + 1) * hd]
                            .iter()
                            .zip(&alone_paged)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "paged: hd {hd}, {tokens} tokens x {heads} heads from {first}, query {k} ({simd:?})"
                    );
                    let runs = [KvRun {
                        keys: &keys,
                        values: &values,
                        len,
                    }];
                    let mut alone = vec![f32::NAN; hd];
                    attend_group(
                        simd,
                        &q[k * hd..(k + 1) * hd],
                        hd,
                        &runs,
                        stride,
                        off,
                        scale,
                        own_sink(k),
                        &mut alone,
                    );
                    let same = got[k * hd..(k + 1) * hd]
                        .iter()
                        .zip(&alone)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "hd {hd}, {tokens} tokens x {heads} heads from {first}, query {k} ({simd:?})"
                    );
                }
            }
        }
    }
}

/// `rows` (rows of `stride` values) with their blocks of 32 rows in the reverse order: a
/// paged cache whose sequence took its blocks from the top of the pool down.
fn blocks_reversed(rows: &[f32], stride: usize) -> Vec<f32> {
    rows.chunks(32 * stride).rev().flatten().copied().collect()
}

/// The first `len` rows of [`blocks_reversed`]'s cache, in position order: one run a block.
fn paged_runs<'a>(keys: &'a [f32], values: &'a [f32], len: usize, stride: usize) -> Vec<KvRun<'a>> {
    let total = keys.len() / stride;
    (0..len.div_ceil(32))
        .map(|b| {
            // Block b holds rows 32·b.. of `size`; the blocks after it come first.
            let size = (total - 32 * b).min(32);
            let at = total - 32 * b - size;
            KvRun {
                keys: &keys[at * stride..(at + size) * stride],
                values: &values[at * stride..(at + size) * stride],
                len: (len - 32 * b).min(32),
            }
        })
        .collect()
}

/// The 8-bit mode's GELU is ggml's CPU table: for every f16 input between −10 and 10 the
/// f16 rounding of GELU at that input (within f16 rounding of the f32 GELU), an input
/// between f16 values taking its rounding's entry, 0 at and below −10, the identity at and
/// above 10.
#[test]
fn ggml_cpu_gelu_is_the_f16_table() {
    use kiln_backend_cpu::ops::gelu_as_ggml_cpu;
    use kiln_core::ir::gelu_tanh;
    let mut seen = 0;
    for bits in 0..=u16::MAX {
        let x = half::f16::from_bits(bits).to_f32();
        if !x.is_finite() || x <= -10.0 || x >= 10.0 {
            continue;
        }
        seen += 1;
        let got = gelu_as_ggml_cpu(x);
        let table = half::f16::from_f32(gelu_tanh(x)).to_f32();
        assert_eq!(got.to_bits(), table.to_bits(), "x = {x}");
        assert!(
            (got - gelu_tanh(x)).abs() <= 1e-3 * (1.0 + gelu_tanh(x).abs()),
            "x = {x}"
        );
        // A value just off the f16 grid reads the entry of its rounding.
        let near = x + x.abs() * 1e-5;
        let rounded = half::f16::from_f32(near).to_f32();
        assert_eq!(
            gelu_as_ggml_cpu(near).to_bits(),
            half::f16::from_f32(gelu_tanh(rounded)).to_f32().to_bits(),
            "x = {near}"
        );
    }
    assert!(seen > 30_000, "{seen} inputs");
    for x in [-10.0f32, -11.5, -1e30] {
        assert_eq!(gelu_as_ggml_cpu(x), 0.0);
    }
    for x in [10.0f32, 12.25, 1e30] {
        assert_eq!(gelu_as_ggml_cpu(x), x);
    }
}
