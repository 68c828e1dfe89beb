//! The memory bound of chat-template rendering, with `GuardedAlloc` installed as the `kiln`
//! binary installs it: templates that build unbounded text in variables (a namespace
//! doubling in a loop, doubling through macro recursion) end in a typed error naming the
//! limit, quickly, and the process goes on rendering ordinary templates afterwards.

use std::time::{Duration, Instant};

use kiln_formats::chat::{limits, memory, ChatMessage, ChatTemplate};

#[global_allocator]
static ALLOC: memory::GuardedAlloc = memory::GuardedAlloc;

fn render(src: &str) -> Result<String, String> {
    let t = ChatTemplate::new(src, "<s>", "</s>").map_err(|e| e.to_string())?;
    t.render(&[ChatMessage::new("user", "hi")], true)
        .map_err(|e| e.to_string())
}

#[test]
fn templates_building_unbounded_text_are_stopped_at_the_memory_limit() {
    let _ = Box::new(0u8); // the allocator has served an allocation: installed
    assert!(memory::installed());
    for src in [
        "{% set ns = namespace(s='xxxxxxxx') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
        "{% macro f(s, n) %}{% if n > 0 %}{{ f(s ~ s, n - 1) }}{% endif %}{% endmacro %}{{ f('x' * 10000000, 20) }}",
        "{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l | join(',') | length }}",
    ] {
        let t = Instant::now();
        let err = render(src).expect_err("an unbounded template must be stopped");
        assert!(err.contains(&format!("more than {} bytes", limits::MEMORY_BYTES)), "{err}");
        assert!(t.elapsed() < Duration::from_secs(10), "took {:?}", t.elapsed());
        println!("stopped in {:?}: {err}", t.elapsed());
    }
    // A template that was stopped refuses later renders at once (no second parked thread).
    let t = ChatTemplate::new("{% set ns = namespace(s='xxxxxxxx') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "", "").unwrap();
    let first = t
        .render(&[ChatMessage::new("user", "hi")], true)
        .unwrap_err()
        .to_string();
    let second = t
        .render(&[ChatMessage::new("user", "hi")], true)
        .unwrap_err()
        .to_string();
    assert!(
        first.contains("more than") && second.contains("an earlier render was stopped"),
        "{first} / {second}"
    );
    // Ordinary rendering goes on.
    let out = render("{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}").unwrap();
    assert_eq!(out, "[user] hi");
}
