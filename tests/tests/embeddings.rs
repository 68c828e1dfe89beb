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
