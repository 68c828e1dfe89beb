//! SmolLM2's tokenizer read from the real GGUF against the committed reference ids of
//! `fixtures/tokenizer_smollm2.json` (made by scripts/fixtures/make_tokenizer_fixture.py from the
//! original Hugging Face tokenizer), and its chat template against transformers' rendering.

use std::io::Write as _;
use std::path::PathBuf;

use kiln_formats::chat::{ChatMessage, ChatTemplate};
use kiln_formats::gguf::GgufFile;
use kiln_formats::tokenizer::Tokenizer;
use serde_json::Value;

const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

fn model_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KILN_TEST_MODEL") {
        return Some(PathBuf::from(p));
    }
    let home = std::env::var_os("HOME")?;
    let p = PathBuf::from(home)
        .join(".cache/kiln/models")
        .join(MODEL_FILE);
    p.exists().then_some(p)
}

fn open_model() -> Option<GgufFile> {
    match model_path() {
        Some(p) => Some(GgufFile::open(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))),
        None => {
            // Written to the stderr handle, not through eprintln!, so the test harness
            // does not capture it and the skip shows in a normal `cargo test` run.
            let _ = writeln!(
                std::io::stderr(),
                "skipped: {MODEL_FILE} not found (set KILN_TEST_MODEL or put it in ~/.cache/kiln/models)"
            );
            None
        }
    }
}

fn fixture() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/tokenizer_smollm2.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).expect("fixture")).expect("fixture JSON")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

#[test]
fn ids_match_the_original_tokenizer_and_decode_round_trips() {
    let Some(file) = open_model() else { return };
    let tok = Tokenizer::from_gguf(&file).expect("tokenizer");
    let fx = fixture();
    let cases = fx["cases"].as_array().expect("cases");
    assert!(
        cases.len() >= 30,
        "fixture has only {} strings",
        cases.len()
    );

    let mut failures = Vec::new();
    for case in cases {
        let text = case["text"].as_str().expect("text");
        let expected = ids(&case["ids"]);
        let got = tok.encode(text, false, true).expect("encode");
        if got != expected {
            failures.push(format!(
                "{text:?} (source {}): expected {expected:?}, got {got:?}",
                case["source"]
            ));
        }
        let back = tok.decode(&got, false);
        if back != text {
            failures.push(format!("{text:?} decodes back as {back:?}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );

    // The fixture must still contain the strings where transformers' GGUF loader is wrong,
    // or this test would not be checking the pre-tokenizer.
    let differing = cases
        .iter()
        .filter(|c| c["references_differ"] == Value::Bool(true))
        .count();
    assert!(
        differing > 0,
        "no fixture string separates the two references"
    );
}

#[test]
fn metadata_ids_and_stop_tokens() {
    let Some(file) = open_model() else { return };
    let tok = Tokenizer::from_gguf(&file).expect("tokenizer");
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.bos(), Some(1));
    assert_eq!(tok.eos(), Some(2));
    assert!(!tok.add_bos_default());
    assert_eq!(tok.piece(1), Some("<|im_start|>"));
    // EOS is <|im_end|>; <|endoftext|> also ends a turn.
    assert_eq!(tok.stop_tokens(), &[2, 0]);
    // Without parse_special, a control token in user text is spelled out, not forged.
    let spelled = tok.encode("<|im_start|>", false, false).unwrap();
    assert!(spelled.len() > 1 && !spelled.contains(&1), "{spelled:?}");
    assert_eq!(tok.decode(&spelled, false), "<|im_start|>");
    // skip_special drops control tokens.
    let with = tok
        .encode("<|im_start|>user\nhi<|im_end|>", false, true)
        .unwrap();
    assert_eq!(tok.decode(&with, true), "user\nhi");
}

#[test]
fn streaming_decode_equals_batch_decode() {
    let Some(file) = open_model() else { return };
    let tok = Tokenizer::from_gguf(&file).expect("tokenizer");
    for case in fixture()["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let ids = tok.encode(text, false, true).unwrap();
        let mut stream = tok.decode_stream(false);
        let mut streamed = String::new();
        for &id in &ids {
            if let Some(s) = stream.push(id) {
                assert!(
                    !s.contains('\u{FFFD}'),
                    "{text:?}: stream emitted a broken character"
                );
                streamed.push_str(&s);
            }
        }
        assert!(stream.flush().is_none(), "{text:?}: bytes left over");
        assert_eq!(streamed, text);
    }
}

#[test]
fn chat_template_matches_transformers() {
    let Some(file) = open_model() else { return };
    let fx = fixture();
    let template = ChatTemplate::from_gguf(&file).expect("template");
    assert_eq!(Some(template.source()), fx["chat_template"].as_str());
    for chat in fx["chats"].as_array().unwrap() {
        let messages: Vec<ChatMessage> = chat["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
            .collect();
        let add_gen = chat["add_generation_prompt"].as_bool().unwrap();
        let rendered = template.render(&messages, add_gen).expect("render");
        assert_eq!(rendered, chat["rendered"].as_str().unwrap());

        let tok = Tokenizer::from_gguf(&file).unwrap();
        assert_eq!(
            tok.encode(&rendered, false, true).unwrap(),
            ids(&chat["rendered_ids"])
        );
    }
}
