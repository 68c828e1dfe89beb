//! The fuzz targets of `fuzz/` (the GGUF reader, GGUF as a model, tokenizers, chat
//! templates; the APR reader's are in apr_container.rs) on stable
//! Rust: each target's committed seed corpus, then mutations of it (bit flips, boundary
//! values written over 1/2/4/8 bytes, truncations, insertions, duplicated spans), every
//! input under `catch_unwind` with a time bound. A panic saves the input under the temp
//! directory and names it. Real coverage-guided fuzzing: `scripts/check/fuzz.sh` (nightly).
//!
//! The mutation seed is fresh each run and printed; `KILN_FUZZ_SEED` replays one,
//! `KILN_FUZZ_CASES` changes the number of mutated inputs per target.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kiln_core::Rng;
use kiln_formats::fuzz;

/// Templates get the memory and time bound the `kiln` binary gives them.
#[global_allocator]
static ALLOC: kiln_formats::chat::memory::GuardedAlloc = kiln_formats::chat::memory::GuardedAlloc;

/// Longest any one input may take: a template at its render time limit (10 s) plus slack.
const TIME_BOUND: Duration = Duration::from_secs(15);

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target)
}

fn corpus(target: &str, seeds: fn() -> Vec<Vec<u8>>) -> Vec<Vec<u8>> {
    let mut inputs: Vec<Vec<u8>> = match std::fs::read_dir(corpus_dir(target)) {
        Ok(dir) => dir
            .map(|e| std::fs::read(e.unwrap().path()).unwrap())
            .collect(),
        Err(_) => Vec::new(),
    };
    assert!(
        !inputs.is_empty(),
        "fuzz/corpus/{target} is committed with seeds"
    );
    inputs.extend(seeds());
    inputs
}

/// `regenerate` the committed seed corpora from the seed functions.
#[test]
#[ignore = "writes fuzz/corpus/{gguf_reader,gguf_model,tokenizer,chat_template}; run with --ignored regenerate"]
fn regenerate() {
    for (target, seeds) in [
        ("gguf_reader", fuzz::gguf_seeds as fn() -> Vec<Vec<u8>>),
        ("gguf_model", fuzz::gguf_seeds),
        ("tokenizer", fuzz::tokenizer_seeds),
        ("chat_template", fuzz::chat_template_seeds),
    ] {
        let dir = corpus_dir(target);
        std::fs::create_dir_all(&dir).unwrap();
        for (i, s) in seeds().iter().enumerate() {
            std::fs::write(dir.join(format!("seed-{i:02}")), s).unwrap();
        }
    }
}

fn mutate(input: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut b = input.to_vec();
    let n = 1 + rng.next_u64() as usize % 8;
    for _ in 0..n {
        let len = b.len().max(1);
        let at = rng.next_u64() as usize % len;
        match rng.next_u64() % 6 {
            0 if !b.is_empty() => b[at] ^= 1 << (rng.next_u64() % 8),
            1 => {
                let width = [1usize, 2, 4, 8][rng.next_u64() as usize % 4];
                let v: u64 = [
                    0,
                    1,
                    0x7f,
                    0x80,
                    0xff,
                    0xffff,
                    0x7fff_ffff,
                    0xffff_ffff,
                    u64::MAX,
                    1 << 40,
                ][rng.next_u64() as usize % 10];
                for (i, byte) in v.to_le_bytes()[..width].iter().enumerate() {
                    if let Some(x) = b.get_mut(at + i) {
                        *x = *byte;
                    }
                }
            }
            2 => b.truncate(at),
            3 => {
                let k = rng.next_u64() as usize % 16;
                for _ in 0..k {
                    b.insert(at.min(b.len()), rng.next_u64() as u8);
                }
            }
            4 if !b.is_empty() => {
                let end = (at + 1 + rng.next_u64() as usize % 64).min(b.len());
                let span = b[at..end].to_vec();
                let to = rng.next_u64() as usize % (b.len() + 1);
                b.splice(to..to, span);
            }
            _ => {
                if let Some(x) = b.get_mut(at) {
                    *x = rng.next_u64() as u8;
                }
            }
        }
    }
    b
}

fn run(target: &str, f: fn(&[u8]), seeds: fn() -> Vec<Vec<u8>>, default_cases: usize) {
    let seed = std::env::var("KILN_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(kiln_core::testdata::fresh_seed);
    let cases = std::env::var("KILN_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default_cases);
    let mut rng = Rng::new(seed);
    let inputs = corpus(target, seeds);
    let (mut slowest, start) = (Duration::ZERO, Instant::now());
    let total = inputs.len() + cases;
    for i in 0..total {
        let input = if i < inputs.len() {
            inputs[i].clone()
        } else {
            mutate(&inputs[rng.next_u64() as usize % inputs.len()], &mut rng)
        };
        let t = Instant::now();
        let outcome = catch_unwind(AssertUnwindSafe(|| f(&input)));
        let took = t.elapsed();
        if outcome.is_err() || took > TIME_BOUND {
            let path = std::env::temp_dir().join(format!("kiln-fuzz-{target}-{seed}-{i}"));
            std::fs::write(&path, &input).unwrap();
            panic!(
                "{target}: input {i} (seed {seed}) {} — saved to {}",
                if outcome.is_err() {
                    "panicked".to_string()
                } else {
                    format!("took {took:?}")
                },
                path.display()
            );
        }
        slowest = slowest.max(took);
    }
    println!(
        "{target}: {total} inputs (seed {seed}), slowest {slowest:?}, total {:?}",
        start.elapsed()
    );
}

#[test]
fn gguf_reader_never_panics() {
    run("gguf_reader", fuzz::gguf_reader, fuzz::gguf_seeds, 5000);
}

#[test]
fn gguf_models_never_panic() {
    run("gguf_model", fuzz::gguf_model, fuzz::gguf_seeds, 3000);
}

#[test]
fn tokenizers_never_panic_and_byte_level_bpe_round_trips() {
    run("tokenizer", fuzz::tokenizer, fuzz::tokenizer_seeds, 3000);
}

#[test]
fn chat_templates_never_panic_or_run_unbounded() {
    run(
        "chat_template",
        fuzz::chat_template,
        fuzz::chat_template_seeds,
        2000,
    );
}

/// Mutations start from files every stage accepts: each GGUF seed maps to a valid IR, a
/// tokenizer and a template that renders.
#[test]
fn gguf_seeds_pass_every_stage() {
    use std::sync::Arc;
    for (i, seed) in fuzz::gguf_seeds().into_iter().enumerate() {
        let file = kiln_formats::gguf::GgufFile::from_storage(Arc::new(seed)).unwrap();
        let ir = kiln_formats::model::model_from_gguf(&file, "seed").unwrap();
        ir.config.validate().unwrap();
        let tok = kiln_formats::tokenizer::Tokenizer::from_gguf(&file).unwrap();
        assert!(
            !tok.encode("the theater", true, false).unwrap().is_empty(),
            "seed {i}"
        );
        let t = kiln_formats::chat::ChatTemplate::from_gguf(&file).unwrap();
        assert!(!t.is_fallback(), "seed {i} carries its template");
        t.render(&[kiln_formats::chat::ChatMessage::new("user", "hi")], true)
            .unwrap();
    }
}

/// Inputs the fuzzers found (fuzz/regressions/TARGET/*), each under the time bound.
#[test]
fn fuzz_regressions_stay_fixed() {
    let targets: [(&str, fn(&[u8])); 5] = [
        ("gguf_reader", fuzz::gguf_reader),
        ("gguf_model", fuzz::gguf_model),
        ("tokenizer", fuzz::tokenizer),
        ("chat_template", fuzz::chat_template),
        ("apr_reader", |_| {}),
    ];
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/regressions");
    for (target, f) in targets {
        let Ok(dir) = std::fs::read_dir(root.join(target)) else {
            continue;
        };
        for e in dir {
            let path = e.unwrap().path();
            let input = std::fs::read(&path).unwrap();
            let t = Instant::now();
            f(&input);
            let took = t.elapsed();
            println!("{target}: {} in {took:?}", path.display());
            assert!(took < TIME_BOUND, "{}: {took:?}", path.display());
        }
    }
}
