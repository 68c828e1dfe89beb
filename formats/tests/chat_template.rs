//! Chat templates: the ChatML fallback, transformers' Jinja conventions (trim/lstrip
//! blocks, Python string methods, raise_exception, tojson) and errors without panics.

use kiln_core::Error;
use kiln_formats::chat::{ChatMessage, ChatTemplate};

fn conv() -> Vec<ChatMessage> {
    vec![ChatMessage::new("user", "Hello?"), ChatMessage::new("assistant", "Hi there.")]
}

#[test]
fn chatml_fallback() {
    let t = ChatTemplate::chatml("<s>", "</s>");
    assert!(t.is_fallback());
    assert_eq!(
        t.render(&conv(), true).unwrap(),
        "<|im_start|>user\nHello?<|im_end|>\n<|im_start|>assistant\nHi there.<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(
        t.render(&conv(), false).unwrap(),
        "<|im_start|>user\nHello?<|im_end|>\n<|im_start|>assistant\nHi there.<|im_end|>\n"
    );
}

#[test]
fn jinja_conventions_of_transformers() {
    // Block tags on their own lines leave no blank lines (trim_blocks + lstrip_blocks);
    // .strip() / .startswith() are Python methods; bos_token is a variable.
    let src = "{{ bos_token }}\n{% for m in messages %}\n    {% if m.role.startswith('u') %}\n[U] {{ m.content.strip() }}\n    {% else %}\n[A] {{ m['content'] | upper }}\n    {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}[A]{% endif %}";
    let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
    let msgs = vec![ChatMessage::new("user", "  padded  "), ChatMessage::new("assistant", "ok")];
    assert_eq!(t.render(&msgs, true).unwrap(), "<s>\n[U] padded\n[A] OK\n[A]");
}

#[test]
fn tojson_writes_python_json() {
    let t = ChatTemplate::new("{{ messages[0] | tojson }}|{{ {'a': [1, 2.5, none, true]} | tojson }}|{{ 'x<y' | tojson }}", "", "")
        .unwrap();
    assert_eq!(
        t.render(&conv()[..1], false).unwrap(),
        r#"{"role": "user", "content": "Hello?"}|{"a": [1, 2.5, null, true]}|"x<y""#
    );
    let t = ChatTemplate::new("{{ {'k': [1]} | tojson(indent=2) }}", "", "").unwrap();
    assert_eq!(t.render(&[], false).unwrap(), "{\n  \"k\": [\n    1\n  ]\n}");
}

#[test]
fn template_errors_are_typed_and_carry_the_message() {
    let t = ChatTemplate::new(
        "{% if messages[0].role != 'system' %}{{ raise_exception('first message must be system') }}{% endif %}",
        "",
        "",
    )
    .unwrap();
    match t.render(&conv(), false) {
        Err(Error::Tokenizer(msg)) => assert!(msg.contains("first message must be system"), "{msg}"),
        other => panic!("expected a template error, got {other:?}"),
    }
    assert!(matches!(ChatTemplate::new("{% for x in %}", "", ""), Err(Error::Tokenizer(_))));
    let t = ChatTemplate::new("{{ messages | nosuchfilter }}", "", "");
    assert!(matches!(t.and_then(|t| t.render(&conv(), false)), Err(Error::Tokenizer(_))));
}
