//! A tour of the host API (docs/host-api.md), on the CPU backend and the default model:
//! a chat prompt, a streamed generation stopped from another thread, errors matched by
//! kind, JSON output, embeddings, and the Batcher fed from several threads.
//!
//! ```sh
//! cargo run --release --example host_tour
//! ```

use std::io::Write;
use std::time::Duration;

use kiln::core::{Error, LoadOptions, Result, SamplingParams};
use kiln::{
    registry_with_plugins, BatchEvent, BatchOptions, Batcher, CancelToken, ChatMessage, Engine,
    GenerateParams, Model, Pooling,
};

fn main() {
    if let Err(e) = run() {
        eprintln!("host_tour: {e}");
        std::process::exit(1);
    }
}

fn load(sequences: usize) -> Result<Engine> {
    let path = kiln::fetch::ensure_default_model(false)?;
    let (registry, _plugin_errors) = registry_with_plugins(&[]);
    let options = LoadOptions {
        max_context: 512,
        max_sequences: sequences,
        ..LoadOptions::default()
    };
    Engine::load(Model::open(&path)?, &registry, Some("cpu"), &options)
}

fn run() -> Result<()> {
    let mut engine = load(1)?;

    // 1. A chat prompt: the template's markup as control tokens, the messages as text.
    let messages = [
        ChatMessage::new("system", "You are brief."),
        ChatMessage::new("user", "Name three colours."),
    ];
    let prompt = engine.model.chat_prompt(&messages)?;

    // 2. A streamed generation that another thread stops after a moment.
    let cancel = CancelToken::new();
    let params = GenerateParams {
        max_tokens: 200,
        sampling: SamplingParams::greedy(),
        frequency_penalty: 0.5,
        cancel: Some(cancel.clone()),
        ..GenerateParams::default()
    };
    let stopper = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        cancel.cancel();
    });
    let generation = {
        let mut session = engine.session()?;
        session.generate(&prompt, &params, |piece| {
            print!("{piece}");
            let _ = std::io::stdout().flush();
        })?
    };
    stopper.join().expect("the stopping thread");
    println!(
        "\n[{} tokens, {}]",
        generation.ids.len(),
        generation.finish.as_str()
    );

    // 3. Errors by kind: a prompt longer than the context says by how much.
    let long = vec![prompt[0]; 600];
    match engine.session()?.generate(&long, &params, |_| {}) {
        Err(Error::ContextExceeded { tokens, context }) => {
            println!("too long: {tokens} tokens for a context of {context}")
        }
        Err(other) => return Err(other),
        Ok(_) => println!("unexpectedly fit"),
    }

    // 4. JSON that matches a schema, whatever the sampler draws.
    let json = GenerateParams {
        max_tokens: 64,
        sampling: SamplingParams::default(),
        json_schema: Some(serde_json::json!({
            "type": "object",
            "properties": {"colour": {"enum": ["red", "green", "blue"]}},
            "required": ["colour"],
            "additionalProperties": false
        })),
        ..GenerateParams::default()
    };
    let ask = engine
        .model
        .chat_prompt(&[ChatMessage::new("user", "Pick a colour.")])?;
    let answer = engine.session()?.generate(&ask, &json, |_| {})?;
    println!("json: {}", answer.text);

    // 5. Embeddings: nearer texts, nearer vectors.
    let tokenize = |e: &Engine, text: &str| {
        let t = &e.model.tokenizer;
        t.encode(text, t.add_bos_default(), false)
    };
    let texts = ["A cat sleeps.", "A kitten naps.", "Interest rates rose."];
    let mut vectors = Vec::new();
    for text in texts {
        let ids = tokenize(&engine, text)?;
        vectors.push(engine.embed(&ids, Pooling::Last, true)?);
    }
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
    println!(
        "similarity: cat~kitten {:.3}, cat~rates {:.3}",
        dot(&vectors[0], &vectors[1]),
        dot(&vectors[0], &vectors[2])
    );
    drop(engine);

    // 6. The Batcher: three threads submit at once; each stream is its own sequence in
    //    one continuous batch, and each delta names its token.
    let batcher = Batcher::start(load(3)?, BatchOptions::default())?;
    std::thread::scope(|scope| {
        for (i, text) in ["Once upon a time", "The best soup is", "In 1969,"]
            .into_iter()
            .enumerate()
        {
            let batcher = &batcher;
            scope.spawn(move || {
                let stream = || -> Result<()> {
                    let ids = batcher.tokenizer().encode(text, false, false)?;
                    let params = GenerateParams {
                        max_tokens: 16,
                        sampling: SamplingParams::greedy(),
                        ..GenerateParams::default()
                    };
                    let (mut out, mut tokens) = (String::from(text), 0);
                    for event in batcher.submit(ids, &params)? {
                        match event {
                            BatchEvent::Delta { text, token, .. } => {
                                out.push_str(&text);
                                tokens += usize::from(token.is_some());
                            }
                            BatchEvent::Done { finish, .. } => {
                                println!("[{i}] {out:?} ({tokens} tokens, {})", finish.as_str())
                            }
                            BatchEvent::Error { message, .. } => println!("[{i}] error: {message}"),
                        }
                    }
                    Ok(())
                };
                if let Err(e) = stream() {
                    println!("[{i}] {e}");
                }
            });
        }
    });
    batcher.finish()?;
    Ok(())
}
