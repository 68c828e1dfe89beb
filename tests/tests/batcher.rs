//! The library's continuous batch (`kiln::Batcher`), as a host application drives it: more
//! generations than slots at once, each the text a `Session` gives alone; cancellation by
//! dropping a stream, from another thread; structured output; `finish` and drop.

use std::time::{Duration, Instant};

use kiln::{BatchEvent, BatchOptions, BatchStream, Batcher, Engine, GenerateParams};
use kiln_core::{LoadOptions, SamplingParams};
use kiln_tests::smollm2_or_skip;

fn engine(path: &std::path::Path, sequences: usize) -> Engine {
    kiln_tests::cpu_engine(
        path,
        &LoadOptions {
            max_context: 512,
            max_sequences: sequences,
            ..Default::default()
        },
    )
}

/// The stream's text and how it finished.
fn collect(stream: BatchStream) -> (String, String) {
    let mut text = String::new();
    for event in stream {
        match event {
            BatchEvent::Delta { text: t, .. } => text.push_str(&t),
            BatchEvent::Done { finish, .. } => return (text, finish.as_str().to_string()),
            BatchEvent::Error { message, .. } => panic!("error event: {message}"),
        }
    }
    panic!("the stream ended without Done")
}

fn gauge(batcher: &Batcher, name: &str) -> f64 {
    let text = batcher.metrics().render();
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap_or_else(|| panic!("{name} not in\n{text}"))
        .parse()
        .unwrap()
}

#[test]
fn more_generations_than_slots_each_as_a_session_gives_it() {
    let Some(path) = smollm2_or_skip("more_generations_than_slots_each_as_a_session_gives_it")
    else {
        return;
    };
    let prompts = [
        "The capital of France is",
        "Once upon a time",
        "def fibonacci(n):",
        "The three primary colours are",
        "Water boils at",
        "My favourite book is",
    ];
    let params = GenerateParams {
        max_tokens: 20,
        sampling: SamplingParams::greedy(),
        ..Default::default()
    };
    // Alone, one after another.
    let mut single = engine(&path, 1);
    let tok = |e: &Engine, p: &str| e.model.tokenizer.encode(p, true, false).unwrap();
    let ids: Vec<Vec<u32>> = prompts.iter().map(|p| tok(&single, p)).collect();
    let alone: Vec<(String, usize)> = ids
        .iter()
        .map(|p| {
            let mut session = single.session().unwrap();
            let g = session.generate(p, &params, |_| {}).unwrap();
            (g.text, g.ids.len())
        })
        .collect();
    drop(single);

    // Six at once on three slots, each read on its own thread.
    let batcher = Batcher::start(engine(&path, 3), BatchOptions::default()).unwrap();
    let streams: Vec<BatchStream> = ids
        .iter()
        .map(|p| batcher.submit(p.clone(), &params).unwrap())
        .collect();
    let readers: Vec<_> = streams
        .into_iter()
        .map(|s| std::thread::spawn(move || collect(s)))
        .collect();
    for (i, r) in readers.into_iter().enumerate() {
        let (text, _) = r.join().unwrap();
        assert_eq!(text, alone[i].0, "prompt {i} ({:?})", prompts[i]);
    }
    assert_eq!(gauge(&batcher, "kiln_running_sequences"), 0.0);
    let generated: usize = alone.iter().map(|a| a.1).sum();
    assert_eq!(
        gauge(&batcher, "kiln_generation_tokens_total") as usize,
        generated
    );
    batcher.finish().unwrap();
}

#[test]
fn dropping_a_stream_cancels_it_and_frees_its_slot() {
    let Some(path) = smollm2_or_skip("dropping_a_stream_cancels_it_and_frees_its_slot") else {
        return;
    };
    let batcher = Batcher::start(engine(&path, 1), BatchOptions::default()).unwrap();
    let prompt = batcher
        .tokenizer()
        .encode("Tell me a very long story.", true, false)
        .unwrap();
    let long = GenerateParams {
        max_tokens: 400,
        sampling: SamplingParams {
            logit_bias: vec![(0, -100.0), (1, -100.0), (2, -100.0)],
            ..SamplingParams::greedy()
        },
        ..Default::default()
    };
    let mut stream = batcher.submit(prompt.clone(), &long).unwrap();
    assert!(matches!(stream.next(), Some(BatchEvent::Delta { .. })));
    // Cancelled from another thread; the one slot is free again for the next generation,
    // which would otherwise wait for 400 tokens.
    std::thread::spawn(move || drop(stream)).join().unwrap();
    let start = Instant::now();
    let short = GenerateParams {
        max_tokens: 4,
        ..long.clone()
    };
    let (_, finish) = collect(batcher.submit(prompt.clone(), &short).unwrap());
    assert_eq!(finish, "length");
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "waited {:?}",
        start.elapsed()
    );
    assert!(gauge(&batcher, "kiln_sequences_cancelled_total") >= 1.0);

    // A schema makes the output JSON; stop_on_eos false is refused.
    let schema = serde_json::json!({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": false});
    let json = GenerateParams {
        max_tokens: 32,
        json_schema: Some(schema),
        ..Default::default()
    };
    let (text, finish) = collect(batcher.submit(prompt.clone(), &json).unwrap());
    assert_eq!(finish, "stop", "{text:?}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(v["ok"].is_boolean(), "{v}");
    let no_eos = GenerateParams {
        stop_on_eos: false,
        ..Default::default()
    };
    assert!(batcher.submit(prompt.clone(), &no_eos).is_err());

    // Dropping the batcher cancels what runs: the stream ends with `cancelled`.
    let stream = batcher.submit(prompt, &long).unwrap();
    let reader = std::thread::spawn(move || collect(stream));
    std::thread::sleep(Duration::from_millis(200));
    drop(batcher);
    assert_eq!(reader.join().unwrap().1, "cancelled");
}

/// A controller thread stops a batch stream it does not hold through the `CancelToken` in
/// its `GenerateParams`: the stream, still read by its owner, ends with `Done` and finish
/// `cancelled` after the text so far, and the slot serves the next generation.
#[test]
fn a_cancel_token_ends_a_stream_read_elsewhere() {
    let Some(path) = smollm2_or_skip("a_cancel_token_ends_a_stream_read_elsewhere") else {
        return;
    };
    let batcher = Batcher::start(engine(&path, 1), BatchOptions::default()).unwrap();
    let prompt = batcher
        .tokenizer()
        .encode("Tell me a very long story.", true, false)
        .unwrap();
    let cancel = kiln::CancelToken::new();
    let long = GenerateParams {
        max_tokens: 400,
        sampling: SamplingParams {
            logit_bias: vec![(0, -100.0), (1, -100.0), (2, -100.0)],
            ..SamplingParams::greedy()
        },
        cancel: Some(cancel.clone()),
        ..Default::default()
    };
    let mut stream = batcher.submit(prompt.clone(), &long).unwrap();
    assert!(matches!(stream.next(), Some(BatchEvent::Delta { .. })));
    std::thread::spawn(move || cancel.cancel()).join().unwrap();
    let (text, finish) = collect(stream);
    assert_eq!(finish, "cancelled", "{text:?}");
    let short = GenerateParams {
        max_tokens: 4,
        cancel: None,
        ..long.clone()
    };
    let (_, finish) = collect(batcher.submit(prompt, &short).unwrap());
    assert_eq!(finish, "length");
    assert!(gauge(&batcher, "kiln_sequences_cancelled_total") >= 1.0);
    batcher.finish().unwrap();
}

/// `Batcher::embed` runs between a running generation's steps and gives what
/// `Engine::embed` gives alone; a bad input is the typed error; `finish` gives the engine
/// back, every sequence freed.
#[test]
fn the_batcher_embeds_beside_a_running_generation() {
    let Some(path) = smollm2_or_skip("the_batcher_embeds_beside_a_running_generation") else {
        return;
    };
    let mut alone = engine(&path, 1);
    let ids = alone
        .model
        .tokenizer
        .encode("The cat sat on the mat.", false, false)
        .unwrap();
    let want = alone.embed(&ids, kiln::Pooling::Mean, true).unwrap();
    drop(alone);
    let batcher = Batcher::start(engine(&path, 2), BatchOptions::default()).unwrap();
    let long = GenerateParams {
        max_tokens: 64,
        sampling: SamplingParams {
            logit_bias: vec![(0, -100.0), (1, -100.0), (2, -100.0)],
            ..SamplingParams::greedy()
        },
        ..Default::default()
    };
    let mut stream = batcher.submit(ids.clone(), &long).unwrap();
    assert!(matches!(stream.next(), Some(BatchEvent::Delta { .. })));
    let got = batcher
        .embed(vec![ids.clone(), ids.clone()], kiln::Pooling::Mean, true)
        .unwrap();
    assert_eq!(got.len(), 2);
    assert!(kiln_tests::cosine(&got[0], &want) > 0.999_999);
    assert_eq!(got[0], got[1]);
    let (_, finish) = collect(stream);
    assert_eq!(finish, "length");
    assert!(matches!(
        batcher.embed(vec![vec![]], kiln::Pooling::Mean, true),
        Err(kiln_core::Error::InvalidArgument(_))
    ));
    // `finish` hands the engine back with every sequence freed, ready for a session.
    let mut engine = batcher.finish().unwrap();
    if let Some(kv) = engine.executor().kv_blocks() {
        assert_eq!(kv.in_use(), 0, "{kv:?}");
    }
    let again = engine.embed(&ids, kiln::Pooling::Mean, true).unwrap();
    assert!(kiln_tests::cosine(&again, &want) > 0.999_999);
}

/// Penalties and logprobs reach both APIs alike: a Batcher stream with a frequency penalty
/// gives the session's text, token ids (each `Delta` names its token) and logprobs, and the
/// penalty changes the greedy text; an out-of-range penalty is refused up front.
#[test]
fn penalties_and_token_ids_match_a_session() {
    let Some(path) = smollm2_or_skip("penalties_and_token_ids_match_a_session") else {
        return;
    };
    let params = GenerateParams {
        max_tokens: 48,
        sampling: SamplingParams::greedy(),
        frequency_penalty: 1.5,
        presence_penalty: 0.5,
        logprobs: Some(3),
        ..Default::default()
    };
    let mut alone = engine(&path, 1);
    let ids = alone
        .model
        .tokenizer
        .encode("Repeat after me: la la la la la", false, false)
        .unwrap();
    let (penalised, plain) = {
        let mut session = alone.session().unwrap();
        let penalised = session.generate(&ids, &params, |_| {}).unwrap();
        let plain_params = GenerateParams {
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            ..params.clone()
        };
        let plain = session.generate(&ids, &plain_params, |_| {}).unwrap();
        (penalised, plain)
    };
    assert_ne!(penalised.text, plain.text, "the penalty changed nothing");
    drop(alone);
    let batcher = Batcher::start(engine(&path, 1), BatchOptions::default()).unwrap();
    // Greedy: each token is its step's most likely, and its logprob the top one's.
    assert_eq!(penalised.logprobs.len(), penalised.ids.len());
    for lp in &penalised.logprobs {
        assert_eq!(lp.top.len(), 3);
        assert_eq!(lp.top[0].0, lp.token);
        assert!(
            (lp.top[0].1 - lp.logprob).abs() < 1e-6 && lp.logprob <= 0.0,
            "{lp:?}"
        );
    }
    let (mut text, mut tokens, mut logprobs) = (String::new(), Vec::new(), Vec::new());
    for event in batcher.submit(ids.clone(), &params).unwrap() {
        match event {
            BatchEvent::Delta {
                text: t,
                token,
                logprob,
                ..
            } => {
                text.push_str(&t);
                tokens.extend(token);
                logprobs.extend(logprob);
            }
            BatchEvent::Done { .. } => break,
            BatchEvent::Error { message, .. } => panic!("{message}"),
        }
    }
    assert_eq!(text, penalised.text);
    assert_eq!(tokens, penalised.ids);
    assert_eq!(logprobs.len(), penalised.logprobs.len());
    for (b, s) in logprobs.iter().zip(&penalised.logprobs) {
        assert_eq!(b.token, s.token);
        assert!((b.logprob - s.logprob).abs() < 1e-4, "{b:?} {s:?}");
    }
    let bad = GenerateParams {
        presence_penalty: 3.0,
        ..params.clone()
    };
    assert!(matches!(
        batcher.submit(ids, &bad),
        Err(kiln_core::Error::InvalidArgument(_))
    ));
    batcher.finish().unwrap();
}
