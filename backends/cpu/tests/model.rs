//! The executor on tiny random models built in memory: prefill vs token-by-token decode,
//! batched vs single decode, truncation, Qwen2/Qwen3 shapes, K-quant weights, a naive
//! f64 reference forward pass, and typed errors for bad input.

mod common;

use common::{rel_err, Spec};
use kiln_backend_cpu::{CpuBackend, Isa};
use kiln_core::{
    quant::dequantize, Activation, Backend, DecodeItem, Error, LayerExecutor, LoadOptions, ModelIr,
    NormKind, RopeKind, Support, TensorView,
};

fn load(ir: &ModelIr, threads: usize, sequences: usize) -> Box<dyn LayerExecutor> {
    load_with(ir, threads, sequences, false)
}

/// As [`load`], with 8-bit activations when `quantized` (`LoadOptions::quantized_activations`).
fn load_with(
    ir: &ModelIr,
    threads: usize,
    sequences: usize,
    quantized: bool,
) -> Box<dyn LayerExecutor> {
    let opts = LoadOptions {
        max_context: 128,
        max_sequences: sequences,
        threads: Some(threads),
        quantized_activations: quantized,
        ..Default::default()
    };
    CpuBackend.load(ir, &opts).expect("load")
}

fn prompt(n: usize, vocab: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed * 97) >> 7) % vocab as u32)
        .collect()
}

/// Logits after each token, decoding one at a time.
fn stepwise(ex: &mut dyn LayerExecutor, tokens: &[u32]) -> Vec<Vec<f32>> {
    let vocab = ex.config().vocab_size;
    let seq = ex.new_sequence().unwrap();
    let out = tokens
        .iter()
        .map(|&t| {
            let mut l = vec![0.0; vocab];
            ex.decode(&[DecodeItem { seq, token: t }], &mut l).unwrap();
            l
        })
        .collect();
    ex.free_sequence(seq).unwrap();
    out
}

fn check_prefill_matches_decode(spec: &Spec, n: usize) {
    // Every instruction set this CPU runs: each has its own many-token register block.
    for isa in Isa::available() {
        let opts = LoadOptions {
            max_context: 128,
            max_sequences: 2,
            threads: Some(2),
            ..Default::default()
        };
        let ex = CpuBackend
            .load_executor_on(&spec.build(42), &opts, isa)
            .expect("load");
        check_prefill_matches_decode_on(spec, n, Box::new(ex), isa);
    }
}

fn check_prefill_matches_decode_on(
    spec: &Spec,
    n: usize,
    mut ex: Box<dyn LayerExecutor>,
    isa: Isa,
) {
    let ir = spec.build(42);
    let vocab = ir.config.vocab_size;
    let tokens = prompt(n + 3, vocab, 1);
    let want = stepwise(ex.as_mut(), &tokens);
    let seq = ex.new_sequence().unwrap();
    let mut logits = vec![0.0; vocab];
    ex.prefill(seq, &tokens[..n], &mut logits).unwrap();
    assert_eq!(ex.sequence_len(seq).unwrap(), n);
    let err = rel_err(&logits, &want[n - 1]);
    assert!(
        err < 1e-4,
        "{:?} {}: prefill of {n} vs stepwise: rel err {err:e}",
        spec.arch,
        isa.name()
    );
    for (i, &t) in tokens[n..].iter().enumerate() {
        ex.decode(&[DecodeItem { seq, token: t }], &mut logits)
            .unwrap();
        let err = rel_err(&logits, &want[n + i]);
        assert!(
            err < 1e-4,
            "{:?} {}: decode {i} after prefill: rel err {err:e}",
            spec.arch,
            isa.name()
        );
    }
    assert!(logits.iter().all(|v| v.is_finite()));
}

#[test]
fn prefill_then_decode_equals_token_by_token() {
    // 2 and 10 use the per-token fused path; 70 spans two batches (64 tokens through the
    // dequantise-once path, 6 fused); 83 ends in a batch of 19 (dequantise-once, four
    // groups of four tokens and a tail of three).
    for n in [1, 2, 10, 70, 83] {
        check_prefill_matches_decode(&Spec::llama(), n);
    }
}

#[test]
fn qwen2_and_qwen3_shapes_run() {
    check_prefill_matches_decode(&Spec::qwen2(), 9);
    check_prefill_matches_decode(&Spec::qwen3(), 9);
}

#[test]
fn kquant_model_runs() {
    check_prefill_matches_decode(&Spec::kquants(), 12);
    check_prefill_matches_decode(&Spec::kquants(), 23);
}

#[test]
fn apr_q4_model_runs() {
    // 2 tokens take the fused per-token kernels, 21 the dequantise-once path.
    check_prefill_matches_decode(&Spec::apr_q4(), 2);
    check_prefill_matches_decode(&Spec::apr_q4(), 21);
}

#[test]
fn batched_decode_equals_each_sequence_alone() {
    // Both arithmetics: with 8-bit activations each token's input is quantised on its own,
    // so batching changes nothing there either.
    for quantized in [false, true] {
        batched_decode_equals_each_sequence_alone_with(quantized);
    }
}

fn batched_decode_equals_each_sequence_alone_with(quantized: bool) {
    let ir = Spec::llama().build(5);
    let vocab = ir.config.vocab_size;
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| prompt(4 + 3 * i, vocab, i as u32)).collect();
    let follow: Vec<Vec<u32>> = (0..3).map(|i| prompt(3, vocab, 10 + i as u32)).collect();

    let mut alone = Vec::new();
    let mut ex = load_with(&ir, 2, 1, quantized);
    for (p, f) in prompts.iter().zip(&follow) {
        let all: Vec<u32> = p.iter().chain(f).copied().collect();
        alone.push(stepwise(ex.as_mut(), &all));
    }

    let mut ex = load_with(&ir, 2, 3, quantized);
    let seqs: Vec<_> = (0..3).map(|_| ex.new_sequence().unwrap()).collect();
    let mut logits = vec![0.0; vocab];
    for (s, p) in seqs.iter().zip(&prompts) {
        ex.prefill(*s, p, &mut logits).unwrap();
    }
    let mut batch_logits = vec![0.0; 3 * vocab];
    for step in 0..3 {
        let batch: Vec<DecodeItem> = (0..3)
            .map(|i| DecodeItem {
                seq: seqs[i],
                token: follow[i][step],
            })
            .collect();
        ex.decode(&batch, &mut batch_logits).unwrap();
        for i in 0..3 {
            let want = &alone[i][prompts[i].len() + step];
            let err = rel_err(&batch_logits[i * vocab..(i + 1) * vocab], want);
            assert!(
                err < 1e-4,
                "sequence {i} step {step} (8-bit activations: {quantized}): rel err {err:e}"
            );
        }
    }
}

#[test]
fn truncate_then_redecode_reproduces_logits() {
    let ir = Spec::llama().build(9);
    let vocab = ir.config.vocab_size;
    let tokens = prompt(12, vocab, 3);
    let mut ex = load(&ir, 1, 1);
    let seq = ex.new_sequence().unwrap();
    let mut first = vec![0.0; vocab];
    ex.prefill(seq, &tokens[..8], &mut first).unwrap();
    let mut after = Vec::new();
    for &t in &tokens[8..] {
        let mut l = vec![0.0; vocab];
        ex.decode(&[DecodeItem { seq, token: t }], &mut l).unwrap();
        after.push(l);
    }
    ex.truncate_sequence(seq, 8).unwrap();
    assert_eq!(ex.sequence_len(seq).unwrap(), 8);
    // Different tokens first, to overwrite the cache, then back to the original ones.
    let mut l = vec![0.0; vocab];
    ex.prefill(seq, &[1, 2, 3], &mut l).unwrap();
    ex.truncate_sequence(seq, 8).unwrap();
    for (i, &t) in tokens[8..].iter().enumerate() {
        ex.decode(&[DecodeItem { seq, token: t }], &mut l).unwrap();
        assert_eq!(l, after[i], "step {i} after truncation");
    }
}

/// A windowed layer keeps a ring of window + 63 rows (67 here): cutting a 120-token
/// sequence back by more than 64 loses rows the next token attends to, and the executor
/// recomputes them from the kept tokens; a short cut keeps the ring as it is. Either way
/// decoding on gives the logits it gave the first time.
#[test]
fn truncating_a_windowed_model_past_its_ring_recomputes() {
    let ir = Spec::gemma3().build(9);
    let vocab = ir.config.vocab_size;
    let tokens = prompt(120, vocab, 4);
    let mut ex = load(&ir, 2, 1);
    let want = stepwise(ex.as_mut(), &tokens);
    let seq = ex.new_sequence().unwrap();
    let mut l = vec![0.0; vocab];
    ex.prefill(seq, &tokens, &mut l).unwrap();
    for cut_to in [110, 40, 100, 3] {
        ex.truncate_sequence(seq, cut_to).unwrap();
        assert_eq!(ex.sequence_len(seq).unwrap(), cut_to);
        for (i, &t) in tokens.iter().enumerate().skip(cut_to) {
            ex.decode(&[DecodeItem { seq, token: t }], &mut l).unwrap();
            let err = rel_err(&l, &want[i]);
            assert!(err < 1e-4, "cut to {cut_to}, position {i}: rel err {err:e}");
        }
    }
}

#[test]
fn thread_count_does_not_change_results() {
    let ir = Spec::llama().build(13);
    let tokens = prompt(20, ir.config.vocab_size, 4);
    let a = stepwise(load(&ir, 1, 1).as_mut(), &tokens);
    let b = stepwise(load(&ir, 2, 1).as_mut(), &tokens);
    assert_eq!(a, b);
}

// ---------------------------------------------------------------- naive reference model

fn deq(t: &TensorView) -> Vec<f64> {
    let mut v = vec![0.0f32; t.elements()];
    dequantize(t.qtype(), t.bytes(), &mut v).unwrap();
    v.into_iter().map(f64::from).collect()
}

/// `w` is rows × cols (row-major): y = W x.
fn mv(w: &[f64], x: &[f64]) -> Vec<f64> {
    w.chunks_exact(x.len())
        .map(|r| r.iter().zip(x).map(|(a, b)| a * b).sum())
        .collect()
}

fn rms(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let s = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + eps).sqrt();
    x.iter().zip(w).map(|(a, g)| a * s * g).collect()
}

/// Rotary embedding of one head written straight from the definition.
fn rope_ref(kind: RopeKind, x: &mut [f64], pos: usize, theta: f64, dims: usize) {
    for i in 0..dims / 2 {
        let angle = pos as f64 * theta.powf(-2.0 * i as f64 / dims as f64);
        let (a, b) = match kind {
            RopeKind::Norm => (2 * i, 2 * i + 1),
            RopeKind::Neox => (i, i + dims / 2),
        };
        let (x0, x1) = (x[a], x[b]);
        x[a] = x0 * angle.cos() - x1 * angle.sin();
        x[b] = x0 * angle.sin() + x1 * angle.cos();
    }
}

/// Logits of every position of `tokens`, computed in f64 with plain loops and a full
/// softmax over the whole prefix.
fn reference_logits(ir: &ModelIr, tokens: &[u32]) -> Vec<Vec<f64>> {
    let c = &ir.config;
    assert_eq!(c.norm, NormKind::Rms);
    let (h, hd, eps) = (c.hidden_size, c.head_dim, c.norm_eps as f64);
    let embd = deq(&ir.weights.token_embd);
    let scale = c.embedding_scale as f64;
    let mut xs: Vec<Vec<f64>> = tokens
        .iter()
        .map(|&t| {
            embd[t as usize * h..(t as usize + 1) * h]
                .iter()
                .map(|v| v * scale)
                .collect()
        })
        .collect();
    for (li, l) in ir.weights.layers.iter().enumerate() {
        // Gemma 3's pattern from its definition: every `global_every`-th layer global, the
        // others over the last `window` positions with the local RoPE base.
        let (window, theta) = match c.sliding_window {
            Some(sw) if (li + 1) % sw.global_every != 0 => {
                (sw.window, sw.local_theta.unwrap_or(c.rope.theta) as f64)
            }
            _ => (usize::MAX, c.rope.theta as f64),
        };
        let (wq, wk, wv, wo) = (
            deq(&l.attn_q),
            deq(&l.attn_k),
            deq(&l.attn_v),
            deq(&l.attn_out),
        );
        let an = deq(&l.attn_norm);
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        let mut qs = Vec::new();
        for (pos, x) in xs.iter().enumerate() {
            let xn = rms(x, &an, eps);
            let add = |mut v: Vec<f64>, b: &Option<TensorView>| {
                if let Some(b) = b {
                    v.iter_mut().zip(deq(b)).for_each(|(a, b)| *a += b);
                }
                v
            };
            let mut q = add(mv(&wq, &xn), &l.attn_q_bias);
            let mut k = add(mv(&wk, &xn), &l.attn_k_bias);
            let v = add(mv(&wv, &xn), &l.attn_v_bias);
            for (heads, norm) in [(&mut q, &l.attn_q_norm), (&mut k, &l.attn_k_norm)] {
                for head in heads.chunks_exact_mut(hd) {
                    if let Some(w) = norm {
                        let n = rms(head, &deq(w), eps);
                        head.copy_from_slice(&n);
                    }
                    rope_ref(c.rope.kind, head, pos, theta, c.rope.rotary_dims);
                }
            }
            qs.push(q);
            ks.push(k);
            vs.push(v);
        }
        let (fg, fu, fd, fnw) = (
            deq(l.ffn_gate.as_ref().unwrap()),
            deq(l.ffn_up.as_ref().unwrap()),
            deq(l.ffn_down.as_ref().unwrap()),
            deq(l.ffn_norm.as_ref().unwrap()),
        );
        for pos in 0..xs.len() {
            let mut att = vec![0.0; c.q_dim()];
            for head in 0..c.num_heads {
                let g = head / c.gqa_ratio();
                let q = &qs[pos][head * hd..(head + 1) * hd];
                let first = (pos + 1).saturating_sub(window);
                let scores: Vec<f64> = (first..=pos)
                    .map(|j| {
                        q.iter()
                            .zip(&ks[j][g * hd..(g + 1) * hd])
                            .map(|(a, b)| a * b)
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let z: f64 = e.iter().sum();
                for (j, p) in (first..=pos).zip(&e) {
                    for d in 0..hd {
                        att[head * hd + d] += p / z * vs[j][g * hd + d];
                    }
                }
            }
            let post = |v: Vec<f64>, w: &Option<TensorView>| match w {
                Some(w) => rms(&v, &deq(w), eps),
                None => v,
            };
            let o = post(mv(&wo, &att), &l.attn_post_norm);
            let x = &mut xs[pos];
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let xn = rms(x, &fnw, eps);
            let (gate, up) = (mv(&fg, &xn), mv(&fu, &xn));
            let act = |g: f64| match c.activation {
                Activation::Silu => g / (1.0 + (-g).exp()),
                // The tanh approximation, as Gemma's `gelu_pytorch_tanh`.
                Activation::Gelu => {
                    0.5 * g
                        * (1.0
                            + ((2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g.powi(3)))
                                .tanh())
                }
                Activation::SwigluOai { .. } => panic!("this reference runs dense models"),
            };
            let gated: Vec<f64> = gate.iter().zip(&up).map(|(&g, u)| act(g) * u).collect();
            let d = post(mv(&fd, &gated), &l.ffn_post_norm);
            x.iter_mut().zip(&d).for_each(|(a, b)| *a += b);
        }
    }
    let on = deq(&ir.weights.output_norm);
    let head = deq(ir.weights.lm_head());
    xs.iter().map(|x| mv(&head, &rms(x, &on, eps))).collect()
}

/// The opt-in 8-bit activations (`LoadOptions::quantized_activations`, `kernels::q8`):
/// decoding stays within the activations' rounding of the f32 oracle, differs from it (so
/// the integer kernels did run), and agrees across instruction sets; a prefill of the same
/// twelve tokens (few enough for the integer kernels too) lands as close.
#[test]
fn quantized_activations_stay_close_to_the_oracle() {
    for spec in [Spec::llama(), Spec::kquants(), Spec::qwen2()] {
        let ir = spec.build(42);
        let tokens = prompt(12, ir.config.vocab_size, 3);
        let want = stepwise(load(&ir, 2, 1).as_mut(), &tokens);
        let mut first: Option<Vec<Vec<f32>>> = None;
        for isa in Isa::available() {
            let opts = LoadOptions {
                max_context: 128,
                max_sequences: 2,
                threads: Some(2),
                quantized_activations: true,
                ..Default::default()
            };
            let mut ex = CpuBackend.load_executor_on(&ir, &opts, isa).expect("load");
            let got = stepwise(&mut ex, &tokens);
            let mut widest = 0.0f32;
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    g.iter().all(|v| v.is_finite()),
                    "{:?} step {i}: non-finite",
                    spec.arch
                );
                let err = rel_err(g, w);
                widest = widest.max(err);
                assert!(
                    err < 0.03,
                    "{:?} {} step {i}: 8-bit activations {err:e} from the oracle",
                    spec.arch,
                    isa.name()
                );
            }
            assert!(
                widest > 0.0,
                "{:?}: 8-bit activations gave the oracle's logits bit for bit",
                spec.arch
            );
            match &first {
                None => first = Some(got),
                Some(f) => {
                    for (i, (g, w)) in got.iter().zip(f).enumerate() {
                        let err = rel_err(g, w);
                        assert!(
                            err < 1e-4,
                            "{:?} {} step {i}: {err:e} from the portable q8 kernels",
                            spec.arch,
                            isa.name()
                        );
                    }
                }
            }
            let seq = ex.new_sequence().unwrap();
            let mut logits = vec![0.0; ir.config.vocab_size];
            ex.prefill(seq, &tokens, &mut logits).unwrap();
            let err = rel_err(&logits, &want[tokens.len() - 1]);
            assert!(
                err < 0.03,
                "{:?} {}: prefill {err:e} from the oracle",
                spec.arch,
                isa.name()
            );
            println!(
                "{:?} {}: widest step {widest:.2e}, prefill {err:.2e}",
                spec.arch,
                isa.name()
            );
        }
    }
}

fn check_against_reference(spec: &Spec) {
    let ir = spec.build(77);
    let tokens = prompt(9, ir.config.vocab_size, 2);
    let want = reference_logits(&ir, &tokens);
    let got = stepwise(load(&ir, 2, 1).as_mut(), &tokens);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let w: Vec<f32> = w.iter().map(|&v| v as f32).collect();
        let err = rel_err(g, &w);
        assert!(
            err < 1e-4,
            "{:?} position {i}: rel err {err:e} against the f64 reference",
            spec.arch
        );
    }
}

#[test]
fn matches_naive_f64_reference_forward() {
    check_against_reference(&Spec::llama());
    check_against_reference(&Spec::qwen2());
    check_against_reference(&Spec::qwen3());
    check_against_reference(&Spec::kquants());
    check_against_reference(&Spec::apr_q4());
    check_against_reference(&Spec::gemma3());
}

/// Gemma 3's windowed layers: prefill and decode agree across the window boundary (the
/// prompt lengths straddle it and the per-token/batched paths), and a single windowed layer
/// forgets a token once it falls out of the window — and only then.
#[test]
fn sliding_window_layers_see_only_the_window() {
    for n in [1, 3, 4, 5, 10, 70] {
        check_prefill_matches_decode(&Spec::gemma3(), n);
    }
    let spec = Spec {
        layers: 1,
        ..Spec::gemma3()
    };
    let ir = spec.build(5);
    let vocab = ir.config.vocab_size;
    let mut ex = load(&ir, 2, 1);
    let base = prompt(9, vocab, 3);
    let last = |ex: &mut dyn LayerExecutor, tokens: &[u32]| stepwise(ex, tokens).pop().unwrap();
    let want = last(ex.as_mut(), &base);
    // The last token (position 8) sees positions 5..=8 through a window of 4.
    for (changed, visible) in [(0, false), (4, false), (5, true), (8, true)] {
        let mut other = base.clone();
        other[changed] = (other[changed] + 1) % vocab as u32;
        let got = last(ex.as_mut(), &other);
        let same = got == want;
        assert_eq!(
            !same,
            visible,
            "changing position {changed} {} the last logits",
            if same { "kept" } else { "changed" }
        );
    }
}

// ---------------------------------------------------------------- errors and registry

fn invalid<T: std::fmt::Debug>(r: kiln_core::Result<T>, what: &str) {
    match r {
        Err(Error::InvalidArgument(_)) => {}
        other => panic!("{what}: expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn bad_input_is_a_typed_error() {
    let ir = Spec::llama().build(1);
    let vocab = ir.config.vocab_size;
    let opts = LoadOptions {
        max_context: 16,
        max_sequences: 1,
        threads: Some(1),
        ..Default::default()
    };
    let mut ex = CpuBackend.load(&ir, &opts).unwrap();
    let mut l = vec![0.0; vocab];
    invalid(
        ex.decode(&[DecodeItem { seq: 5, token: 1 }], &mut l),
        "unknown sequence",
    );
    invalid(ex.sequence_len(5), "unknown sequence len");
    invalid(ex.free_sequence(5), "free unknown");
    let seq = ex.new_sequence().unwrap();
    invalid(ex.new_sequence(), "no free slot");
    invalid(
        ex.prefill(seq, &[vocab as u32], &mut l),
        "token out of vocab",
    );
    invalid(
        ex.decode(
            &[DecodeItem {
                seq,
                token: u32::MAX,
            }],
            &mut l,
        ),
        "token out of vocab in decode",
    );
    invalid(
        ex.prefill(seq, &[1, 2], &mut l[..vocab - 1]),
        "short logits",
    );
    invalid(
        ex.decode(&[DecodeItem { seq, token: 1 }], &mut vec![0.0; vocab + 1]),
        "long logits",
    );
    invalid(ex.prefill(seq, &[], &mut l), "empty prompt");
    invalid(
        ex.prefill(seq, &[1; 17], &mut l),
        "prompt longer than the context",
    );
    assert_eq!(
        ex.sequence_len(seq).unwrap(),
        0,
        "failed calls leave the sequence untouched"
    );
    ex.prefill(seq, &[1; 16], &mut l).unwrap();
    invalid(
        ex.decode(&[DecodeItem { seq, token: 1 }], &mut l),
        "context full",
    );
    invalid(ex.truncate_sequence(seq, 17), "truncate past the end");
    ex.free_sequence(seq).unwrap();
    invalid(ex.sequence_len(seq), "freed sequence");
    let again = ex.new_sequence().unwrap();
    assert_ne!(
        again, seq,
        "ids of freed sequences are not handed out again at once"
    );
}

#[test]
fn backend_registers_and_judges_models() {
    let reg = kiln_core::Registry::with_builtins();
    let cpu = reg
        .get("cpu")
        .expect("cpu backend registered through inventory");
    assert!(cpu.probe().unwrap().contains("threads"));
    let ir = Spec::llama().build(2);
    assert_eq!(cpu.supports(&ir).score(), Some(10));

    let mut odd = ir.clone();
    let q = &odd.weights.layers[0].attn_q;
    odd.weights.layers[0].attn_q = TensorView::from_bytes(
        "blk.0.attn_q",
        kiln_core::QType::Q8_1,
        q.dims().to_vec(),
        vec![0; kiln_core::QType::Q8_1.tensor_bytes(q.dims()).unwrap()],
    )
    .unwrap();
    match cpu.supports(&odd) {
        Support::No { reason } => assert!(reason.contains("q8_1"), "{reason}"),
        s => panic!("expected a refusal, got {s:?}"),
    }
    assert!(cpu.load(&odd, &LoadOptions::default()).is_err());

    let mut wrong = ir.clone();
    wrong.config.hidden_size = 32;
    assert!(
        cpu.load(&wrong, &LoadOptions::default()).is_err(),
        "shape mismatch must be refused"
    );
}
