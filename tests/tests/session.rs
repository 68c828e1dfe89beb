//! Sessions reuse the cached prefix of a conversation and give the same tokens as a fresh
//! session would.

use kiln::{registry_with_plugins, Engine, GenerateParams, Model};
use kiln_core::{LoadOptions, SamplingParams};
use kiln_formats::chat::ChatMessage;
use kiln_tests::smollm2_or_skip;

/// The model at `path` on the CPU backend with a 512-token context.
fn cpu_engine(path: &std::path::Path) -> Engine {
    kiln_tests::cpu_engine(
        path,
        &LoadOptions {
            max_context: 512,
            ..Default::default()
        },
    )
}

/// `messages` through the model's chat template, as token ids.
fn chat_ids(engine: &Engine, messages: &[ChatMessage]) -> Vec<u32> {
    engine.model.chat_prompt(messages).unwrap()
}

#[test]
fn second_turn_prefills_only_new_tokens_and_matches_a_fresh_session() {
    let Some(path) =
        smollm2_or_skip("second_turn_prefills_only_new_tokens_and_matches_a_fresh_session")
    else {
        return;
    };
    let mut engine = cpu_engine(&path);
    let params = GenerateParams {
        max_tokens: 24,
        sampling: SamplingParams::greedy(),
        ..Default::default()
    };

    let mut messages = vec![ChatMessage::new("user", "What is the capital of France?")];
    let first_prompt = chat_ids(&engine, &messages);
    let (first, second_prompt, second) = {
        let mut session = engine.session().unwrap();
        let first = session.generate(&first_prompt, &params, |_| {}).unwrap();
        assert_eq!(first.prefilled, first_prompt.len());
        messages.push(ChatMessage::new("assistant", first.text.trim()));
        messages.push(ChatMessage::new("user", "And of Germany?"));
        let second_prompt = chat_ids(session.engine(), &messages);
        let second = session.generate(&second_prompt, &params, |_| {}).unwrap();
        (first, second_prompt, second)
    };
    assert!(first.text.contains("Paris"), "{}", first.text);
    assert!(
        second.prefilled < second_prompt.len() - first_prompt.len() + 8,
        "the second turn prefilled {} of {} tokens; the first turn's {} should have been reused",
        second.prefilled,
        second_prompt.len(),
        first_prompt.len()
    );
    let fresh = engine
        .session()
        .unwrap()
        .generate(&second_prompt, &params, |_| {})
        .unwrap();
    assert_eq!(
        fresh.ids, second.ids,
        "reusing the cache must not change greedy tokens"
    );
    assert!(second.text.contains("Berlin"), "{}", second.text);
}

#[test]
fn diverging_prompt_rolls_the_cache_back() {
    let Some(path) = smollm2_or_skip("diverging_prompt_rolls_the_cache_back") else {
        return;
    };
    let (registry, _) = registry_with_plugins(&[]);
    let mut engine = Engine::load(
        Model::open(&path).unwrap(),
        &registry,
        Some("cpu"),
        &LoadOptions::default(),
    )
    .unwrap();
    let params = GenerateParams {
        max_tokens: 8,
        sampling: SamplingParams::greedy(),
        ..Default::default()
    };
    let tok = |e: &Engine, s: &str| e.model.tokenizer.encode(s, false, false).unwrap();
    let a = tok(&engine, "The capital of France is");
    let b = tok(&engine, "The capital of Spain is");
    let mut session = engine.session().unwrap();
    session.generate(&a, &params, |_| {}).unwrap();
    let reused = session.generate(&b, &params, |_| {}).unwrap();
    assert_eq!(
        reused.prefilled,
        b.len() - 3,
        "\"The capital of\" is shared"
    );
    drop(session);
    let fresh = engine
        .session()
        .unwrap()
        .generate(&b, &params, |_| {})
        .unwrap();
    assert_eq!(fresh.ids, reused.ids);
}

/// Structured output through the library: with `json_schema` the text is a JSON value of
/// that schema at a hot temperature, whatever the seed; a schema that cannot be used is an
/// `InvalidArgument` that leaves the session's cache as it was.
#[test]
fn json_schema_constrains_the_generation() {
    let Some(path) = smollm2_or_skip("json_schema_constrains_the_generation") else {
        return;
    };
    let mut engine = cpu_engine(&path);
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "count": {"type": "integer", "minimum": 1, "maximum": 99},
        },
        "required": ["colour", "count"],
        "additionalProperties": false,
    });
    let prompt = chat_ids(
        &engine,
        &[ChatMessage::new("user", "Pick a colour and a number.")],
    );
    let mut session = engine.session().unwrap();
    for seed in 0..3 {
        let params = GenerateParams {
            max_tokens: 64,
            sampling: SamplingParams {
                temperature: 1.2,
                seed,
                ..Default::default()
            },
            json_schema: Some(schema.clone()),
            ..Default::default()
        };
        let g = session.generate(&prompt, &params, |_| {}).unwrap();
        assert_eq!(g.finish, kiln::Finish::Stop, "{:?}", g.text);
        let v: serde_json::Value =
            serde_json::from_str(&g.text).unwrap_or_else(|e| panic!("{e}: {:?}", g.text));
        assert!(
            ["red", "green", "blue"].contains(&v["colour"].as_str().unwrap_or("")),
            "{v}"
        );
        assert!(
            v["count"].as_u64().is_some_and(|c| (1..=99).contains(&c)),
            "{v}"
        );
        assert_eq!(v.as_object().unwrap().len(), 2, "{v}");
    }
    let before = session.cached_tokens().to_vec();
    let bad = GenerateParams {
        json_schema: Some(serde_json::json!({"type": "frobnicate"})),
        ..Default::default()
    };
    let e = session.generate(&prompt[..3], &bad, |_| {}).unwrap_err();
    assert!(matches!(e, kiln_core::Error::InvalidArgument(_)), "{e}");
    assert_eq!(
        session.cached_tokens(),
        before.as_slice(),
        "a refused call changes nothing"
    );
}

/// A generation stops from another thread through its `CancelToken` (with the text so far
/// and `Finish::Cancelled`), the session goes on afterwards, and an over-long prompt is the
/// typed `ContextExceeded` with its numbers.
#[test]
fn a_generation_is_cancelled_from_another_thread_and_a_long_prompt_is_typed() {
    let Some(path) = smollm2_or_skip("a_generation_is_cancelled_from_another_thread") else {
        return;
    };
    let mut engine = cpu_engine(&path);
    let prompt = chat_ids(
        &engine,
        &[ChatMessage::new("user", "Tell me a long story.")],
    );
    let cancel = kiln::CancelToken::new();
    let params = GenerateParams {
        max_tokens: 400,
        sampling: SamplingParams::greedy(),
        stop_on_eos: false,
        cancel: Some(cancel.clone()),
        ..Default::default()
    };
    let mut session = engine.session().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let controller = std::thread::spawn(move || {
        // Cancel once the generation has produced its first pieces.
        rx.recv().unwrap();
        cancel.cancel();
    });
    let mut pieces = 0;
    let mut tx = Some(tx);
    let g = session
        .generate(&prompt, &params, |_| {
            pieces += 1;
            if pieces == 5 {
                if let Some(tx) = tx.take() {
                    tx.send(()).unwrap();
                }
            }
        })
        .unwrap();
    controller.join().unwrap();
    assert_eq!(g.finish, kiln::Finish::Cancelled, "{:?}", g.text);
    assert!(
        g.ids.len() >= 5 && g.ids.len() < 400,
        "{} tokens before the cancel took",
        g.ids.len()
    );
    // The session is usable afterwards, and a fresh token runs to its length.
    let again = GenerateParams {
        max_tokens: 3,
        sampling: SamplingParams::greedy(),
        stop_on_eos: false,
        cancel: Some(kiln::CancelToken::new()),
        ..Default::default()
    };
    let g = session.generate(&prompt, &again, |_| {}).unwrap();
    assert_eq!((g.finish, g.ids.len()), (kiln::Finish::Length, 3));
    let long = vec![prompt[0]; 600];
    match session.generate(&long, &again, |_| {}) {
        Err(kiln_core::Error::ContextExceeded { tokens, context }) => {
            assert_eq!((tokens, context), (600, 512));
        }
        other => panic!("{other:?}"),
    }
}
