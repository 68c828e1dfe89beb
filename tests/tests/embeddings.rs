//! Embeddings (`Engine::embed`) on the CPU oracle against an independent reference:
//! transformers' `last_hidden_state` of the same SmolLM2 GGUF in float32, mean- and
//! last-token-pooled and L2-normalised (tests/fixtures/smollm2_embeddings, made by
//! scripts/fixtures/make_embedding_fixture.py from the same token ids).

use kiln::Pooling;
use kiln_core::LoadOptions;
use kiln_tests::{cosine, fixture, smollm2_or_skip};
use serde::Deserialize;

#[derive(Deserialize)]
struct Reference {
    model_sha256: String,
    entries: Vec<Entry>,
}

#[derive(Deserialize)]
struct Entry {
    text: String,
    ids: Vec<u32>,
    mean: Vec<f32>,
    last: Vec<f32>,
}

#[test]
fn pooled_hidden_states_match_transformers() {
    let Some(path) = smollm2_or_skip("pooled_hidden_states_match_transformers") else {
        return;
    };
    let reference: Reference = serde_json::from_str(
        &std::fs::read_to_string(fixture("smollm2_embeddings/reference.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        reference.model_sha256,
        kiln::fetch::SMOLLM2.sha256,
        "the fixture was made from another file"
    );
    let mut engine = kiln_tests::cpu_engine(
        &path,
        &LoadOptions {
            max_context: 256,
            ..Default::default()
        },
    );
    let mut vectors = Vec::new();
    for e in &reference.entries {
        for (pooling, expected) in [(Pooling::Mean, &e.mean), (Pooling::Last, &e.last)] {
            let v = engine.embed(&e.ids, pooling, true).unwrap();
            let norm: f64 = v.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
            assert!((norm - 1.0).abs() < 1e-5, "{norm}");
            let c = cosine(&v, expected);
            println!("{:?} {:<5} cosine {c:.7}", e.text, pooling.as_str());
            assert!(c >= 0.9999, "{:?} {}: cosine {c}", e.text, pooling.as_str());
            if pooling == Pooling::Mean {
                vectors.push(v);
            }
        }
    }
    // The texts about a cat are nearer each other than either is to the stock market.
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
    assert!(dot(&vectors[0], &vectors[1]) > dot(&vectors[0], &vectors[2]));
    // Unnormalised, the same direction; a sequence is left free either way.
    let raw = engine
        .embed(&reference.entries[0].ids, Pooling::Mean, false)
        .unwrap();
    assert!(cosine(&raw, &vectors[0]) > 0.999_999);
    assert_eq!(engine.executor().max_sequences(), 1);
    let again = engine
        .embed(&reference.entries[0].ids, Pooling::Mean, true)
        .unwrap();
    assert_eq!(
        again, vectors[0],
        "embedding is deterministic and leaves no state behind"
    );
    // Bad input: typed errors.
    assert!(matches!(
        engine.embed(&[], Pooling::Mean, true),
        Err(kiln_core::Error::InvalidArgument(_))
    ));
    assert!(matches!(
        engine.embed(&vec![1; 300], Pooling::Last, true),
        Err(kiln_core::Error::ContextExceeded {
            tokens: 300,
            context: 256
        })
    ));
    assert!(matches!(
        engine.embed(&[1, 1 << 30], Pooling::Mean, true),
        Err(kiln_core::Error::InvalidArgument(_))
    ));
}

/// `prefill_hidden_batch` on the CPU packs several sequences' rows into shared passes: on
/// every conformance shape (sliding windows and experts included), a batch of sequences of
/// different lengths — one already holding tokens, one asked for its last row only, one
/// longer than a pass — gives each row what `prefill_hidden` gives it alone, and leaves
/// each sequence where a one-at-a-time prefill would (the next decode's logits equal).
/// Refused batches change nothing.
#[test]
fn batched_hidden_states_equal_one_sequence_at_a_time() {
    use kiln_core::{DecodeItem, HiddenRequest, Rng};
    let cpu = kiln_core::Registry::with_builtins()
        .get("cpu")
        .expect("the cpu backend");
    for (name, shape) in kiln::conformance::models::suite_shapes() {
        let ir = kiln::conformance::models::model(&mut Rng::new(5), &shape, 512);
        let (vocab, width) = (ir.config.vocab_size, ir.config.hidden_size);
        let options = LoadOptions {
            max_context: 256,
            max_sequences: 4,
            ..Default::default()
        };
        let mut alone = cpu.load(&ir, &options).unwrap();
        let mut packed = cpu.load(&ir, &options).unwrap();
        let mut rng = Rng::new(kiln_core::testdata::fresh_seed());
        let mut prompt = |n: usize| -> Vec<u32> {
            (0..n)
                .map(|_| (rng.next_u64() % vocab as u64) as u32)
                .collect()
        };
        let (lead, a, b, c) = (prompt(9), prompt(30), prompt(1), prompt(150));
        let mut seqs = Vec::new();
        for e in [&mut alone, &mut packed] {
            let s: Vec<_> = (0..3).map(|_| e.new_sequence().unwrap()).collect();
            // The first sequence already holds tokens.
            let mut scratch = vec![0f32; 9 * width];
            e.prefill_hidden(s[0], &lead, 0, &mut scratch).unwrap();
            seqs.push(s);
        }
        let items = |s: &[u32]| {
            vec![
                HiddenRequest {
                    seq: s[0],
                    tokens: &a,
                    first: 0,
                },
                HiddenRequest {
                    seq: s[1],
                    tokens: &b,
                    first: 0,
                },
                HiddenRequest {
                    seq: s[2],
                    tokens: &c,
                    first: 149,
                },
            ]
        };
        let rows = 30 + 1 + 1;
        let mut want = vec![0f32; rows * width];
        let (x, y) = want.split_at_mut(30 * width);
        let (y, z) = y.split_at_mut(width);
        alone.prefill_hidden(seqs[0][0], &a, 0, x).unwrap();
        alone.prefill_hidden(seqs[0][1], &b, 0, y).unwrap();
        alone.prefill_hidden(seqs[0][2], &c, 149, z).unwrap();
        // Refused: a wrong buffer, a sequence twice, a first row past the tokens.
        let mut got = vec![f32::NAN; rows * width];
        let mut its = items(&seqs[1]);
        assert!(packed
            .prefill_hidden_batch(&its, &mut got[width..])
            .is_err());
        its[1].seq = its[0].seq;
        assert!(packed.prefill_hidden_batch(&its, &mut got).is_err());
        let mut its = items(&seqs[1]);
        its[2].first = 150;
        assert!(packed.prefill_hidden_batch(&its, &mut got).is_err());
        for &s in &seqs[1] {
            assert_eq!(
                packed.sequence_len(s).unwrap(),
                if s == seqs[1][0] { 9 } else { 0 }
            );
        }
        packed
            .prefill_hidden_batch(&items(&seqs[1]), &mut got)
            .unwrap();
        let mut worst = 0f64;
        for (r, (w, g)) in want.chunks(width).zip(got.chunks(width)).enumerate() {
            assert!(
                g.iter().all(|v| v.is_finite()),
                "{name}: row {r} not finite"
            );
            let c = cosine(w, g);
            worst = worst.max(1.0 - c);
            assert!(c >= 0.999_999, "{name}: row {r}: cosine {c}");
        }
        // Each sequence goes on from where it was left.
        for (i, len) in [(0, 39), (1, 1), (2, 150)] {
            let (sa, sp) = (seqs[0][i], seqs[1][i]);
            assert_eq!(packed.sequence_len(sp).unwrap(), len);
            let (mut la, mut lp) = (vec![0f32; vocab], vec![f32::NAN; vocab]);
            alone
                .decode(&[DecodeItem { seq: sa, token: 3 }], &mut la)
                .unwrap();
            packed
                .decode(&[DecodeItem { seq: sp, token: 3 }], &mut lp)
                .unwrap();
            let c = cosine(&la, &lp);
            assert!(
                c >= 0.999_999,
                "{name}: sequence {i} after the batch: cosine {c}"
            );
        }
        println!("{name}: batched hidden states within 1 - cosine {worst:.1e} of one at a time");
    }
}
