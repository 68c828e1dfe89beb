//! `kiln perplexity` and its library: the scoring against an independent computation, the
//! saved-logits file (round trip, and every way a bad file is refused), KL-divergence of a
//! model from itself and from a coarser quantisation, and the CLI's errors on bad input.

use std::path::{Path, PathBuf};

use kiln::perplexity::{
    score, tokenizer_fingerprint, LogitsHeader, LogitsReader, LogitsWriter, Plan, QuantRow,
    Reference,
};
use kiln_core::{DecodeItem, Error, LayerExecutor, Rng, SeqId, TokenScore};
use kiln_formats::quantize::Recipe;
use kiln_formats::synth::Preset;
use kiln_tests::{cpu_executor, kiln_binary, synthetic_model, tiny_llama};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-ppl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn random_tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = Rng::new(seed);
    (0..n)
        .map(|_| (rng.next_u64() % vocab as u64) as u32)
        .collect()
}

/// log-softmax of one row in f64, the textbook way.
fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = row
        .iter()
        .map(|&l| (l as f64 - max).exp())
        .sum::<f64>()
        .ln()
        + max;
    row.iter().map(|&l| l as f64 - lse).collect()
}

/// The executor with `prefill_logits` left to the trait's default (prefill, then one
/// decode a token): the path every plugin gets.
struct DefaultScoring(Box<dyn LayerExecutor>);

impl LayerExecutor for DefaultScoring {
    fn config(&self) -> &kiln_core::ModelConfig {
        self.0.config()
    }
    fn max_context(&self) -> usize {
        self.0.max_context()
    }
    fn max_sequences(&self) -> usize {
        self.0.max_sequences()
    }
    fn new_sequence(&mut self) -> kiln_core::Result<SeqId> {
        self.0.new_sequence()
    }
    fn free_sequence(&mut self, seq: SeqId) -> kiln_core::Result<()> {
        self.0.free_sequence(seq)
    }
    fn sequence_len(&self, seq: SeqId) -> kiln_core::Result<usize> {
        self.0.sequence_len(seq)
    }
    fn truncate_sequence(&mut self, seq: SeqId, len: usize) -> kiln_core::Result<()> {
        self.0.truncate_sequence(seq, len)
    }
    fn prefill(&mut self, seq: SeqId, tokens: &[u32], logits: &mut [f32]) -> kiln_core::Result<()> {
        self.0.prefill(seq, tokens, logits)
    }
    fn decode(&mut self, batch: &[DecodeItem], logits: &mut [f32]) -> kiln_core::Result<()> {
        self.0.decode(batch, logits)
    }
}

/// The CPU's one-pass `prefill_logits` gives, row for row, what a prefill of each prefix
/// gives (its last logits), and what the trait's default (decode a token at a time) gives;
/// refused calls change nothing.
#[test]
fn prefill_logits_rows_are_each_prefix_s_last_logits() {
    let ir = tiny_llama(32);
    let vocab = ir.config.vocab_size;
    let tokens = random_tokens(150, vocab, 11);
    let first = 70;
    let rows = tokens.len() - first;
    let mut exec = cpu_executor(&ir, 256);
    let seq = exec.new_sequence().unwrap();
    let mut got = vec![f32::NAN; rows * vocab];
    exec.prefill_logits(seq, &tokens, first, &mut got).unwrap();
    assert_eq!(exec.sequence_len(seq).unwrap(), tokens.len());
    let mut default = DefaultScoring(cpu_executor(&ir, 256));
    let dseq = default.new_sequence().unwrap();
    let mut by_decode = vec![f32::NAN; rows * vocab];
    default
        .prefill_logits(dseq, &tokens, first, &mut by_decode)
        .unwrap();
    let mut one = vec![f32::NAN; vocab];
    for (j, t) in [0, 1, 33, rows - 1].into_iter().map(|j| (j, first + j)) {
        let mut fresh = cpu_executor(&ir, 256);
        let s = fresh.new_sequence().unwrap();
        fresh.prefill(s, &tokens[..=t], &mut one).unwrap();
        let row = &got[j * vocab..(j + 1) * vocab];
        let cos = kiln_tests::cosine(row, &one);
        assert!(
            cos > 0.99999,
            "row {j}: cosine {cos} to the prefix's prefill"
        );
        let dec = &by_decode[j * vocab..(j + 1) * vocab];
        let cos = kiln_tests::cosine(row, dec);
        assert!(
            cos > 0.99999,
            "row {j}: cosine {cos} to the decode-a-token default"
        );
    }
    assert!(got.iter().all(|l| l.is_finite()));
    // Refused calls: a buffer of the wrong size, `first` past the tokens, past the context.
    let before = exec.sequence_len(seq).unwrap();
    for (toks, first, len) in [
        (&tokens[..10], 2usize, 7 * vocab),
        (&tokens[..10], 10, 0),
        (&tokens[..], 149, vocab),
    ] {
        let mut buf = vec![0f32; len];
        let e = exec.prefill_logits(seq, toks, first, &mut buf).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        assert_eq!(exec.sequence_len(seq).unwrap(), before);
    }
}

/// `prefill_scores` (what a plain perplexity run asks for) keeps of each row its nll of the
/// next token and its argmax, as the textbook log-softmax of `prefill_logits`' rows gives
/// them; a row with a non-finite value or a target outside it scores NaN; refused calls
/// (targets or scores of the wrong length, a target outside the vocabulary) change nothing.
#[test]
fn prefill_scores_are_the_rows_nll_and_argmax() {
    let ir = tiny_llama(32);
    let vocab = ir.config.vocab_size;
    let tokens = random_tokens(120, vocab, 21);
    let first = 50;
    let rows = tokens.len() - first;
    let targets = random_tokens(rows, vocab, 22);
    let mut exec = cpu_executor(&ir, 256);
    let seq = exec.new_sequence().unwrap();
    let mut logits = vec![f32::NAN; rows * vocab];
    exec.prefill_logits(seq, &tokens, first, &mut logits)
        .unwrap();
    exec.truncate_sequence(seq, 0).unwrap();
    let nan = TokenScore {
        nll: f32::NAN,
        top: u32::MAX,
    };
    let mut scores = vec![nan; rows];
    exec.prefill_scores(seq, &tokens, first, &targets, &mut scores)
        .unwrap();
    assert_eq!(exec.sequence_len(seq).unwrap(), tokens.len());
    for (j, (row, s)) in logits.chunks(vocab).zip(&scores).enumerate() {
        let want = -log_softmax(row)[targets[j] as usize];
        assert!(
            (s.nll as f64 - want).abs() < 1e-4 * want.abs().max(1.0),
            "row {j}: nll {} vs {want}",
            s.nll
        );
        assert_eq!(s.top, kiln_core::argmax(row), "row {j}");
    }
    let mut bad_row = vec![0.5f32; 8];
    assert_eq!(TokenScore::of(&bad_row, 3).top, 0);
    assert!((TokenScore::of(&bad_row, 3).nll - 8f32.ln()).abs() < 1e-6);
    bad_row[5] = f32::NAN;
    assert!(TokenScore::of(&bad_row, 3).nll.is_nan());
    assert!(TokenScore::of(&[0.0; 8], 8).nll.is_nan());

    let before = exec.sequence_len(seq).unwrap();
    let mut out_of_vocab = targets[..10].to_vec();
    out_of_vocab[4] = vocab as u32;
    for (toks, first, targets, len) in [
        (&tokens[..20], 10usize, &targets[..9], 10usize),
        (&tokens[..20], 10, &targets[..10], 11),
        (&tokens[..20], 10, &out_of_vocab[..], 10),
        (&tokens[..20], 20, &targets[..0], 0),
    ] {
        let mut buf = vec![nan; len];
        let e = exec
            .prefill_scores(seq, toks, first, targets, &mut buf)
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        assert_eq!(exec.sequence_len(seq).unwrap(), before);
    }
}

/// `score` against the textbook computation: chunks evaluated from an empty cache with the
/// BOS in front, the second half scored, PPL = exp(mean nll) and its standard error.
#[test]
fn perplexity_equals_the_textbook_computation() {
    let ir = tiny_llama(32);
    let vocab = ir.config.vocab_size;
    let (ctx, bos) = (64, 1u32);
    let tokens = random_tokens(3 * ctx + 17, vocab, 5);
    let plan = Plan::new(tokens.clone(), ctx, None, Some(bos)).unwrap();
    assert_eq!(
        (plan.chunks, plan.tokens.len(), plan.first()),
        (3, 3 * ctx, 32)
    );
    let mut exec = cpu_executor(&ir, ctx);
    let mut chunks_seen = Vec::new();
    let report = score(exec.as_mut(), &plan, Reference::None, |d| {
        chunks_seen.push(d.ppl)
    })
    .unwrap();
    assert_eq!(report.tokens_scored, 3 * 31);
    assert_eq!(chunks_seen, report.running);

    let mut nlls = Vec::new();
    let mut one = vec![0f32; vocab];
    for c in 0..3 {
        let chunk = &tokens[c * ctx..(c + 1) * ctx];
        for j in 32..ctx - 1 {
            let mut fresh = cpu_executor(&ir, ctx);
            let s = fresh.new_sequence().unwrap();
            let mut input = chunk[..=j].to_vec();
            input[0] = bos;
            fresh.prefill(s, &input, &mut one).unwrap();
            nlls.push(-log_softmax(&one)[chunk[j + 1] as usize]);
        }
    }
    let n = nlls.len() as f64;
    let mean = nlls.iter().sum::<f64>() / n;
    let var = nlls.iter().map(|x| x * x).sum::<f64>() / n - mean * mean;
    let (ppl, err) = (mean.exp(), mean.exp() * (var / (n - 1.0)).sqrt());
    assert!(
        (report.ppl.value / ppl - 1.0).abs() < 1e-4,
        "{} vs {ppl}",
        report.ppl.value
    );
    assert!(
        (report.ppl.error / err - 1.0).abs() < 1e-3,
        "{} vs {err}",
        report.ppl.error
    );
    // The executor is left as it was found.
    assert!(exec.new_sequence().is_ok());
}

#[test]
fn short_texts_and_bad_plans_are_refused() {
    let e = Plan::new(vec![1; 1000], 512, None, None).unwrap_err();
    assert!(e.to_string().contains("needs at least 1024"), "{e}");
    assert!(Plan::new(vec![1; 100], 2, None, None).is_err());
    assert!(Plan::new(vec![1; 100], 8, Some(0), None).is_err());
    assert_eq!(Plan::new(vec![1; 100], 8, Some(3), None).unwrap().chunks, 3);
}

/// A row of log-probabilities read back from 16 bits is within half a grid step of the
/// exact value wherever it is not clamped (16 nats under the best), and at the floor where
/// it is.
#[test]
fn quantised_rows_keep_log_probabilities() {
    let mut rng = Rng::new(9);
    for spread in [0.5f32, 5.0, 40.0] {
        let row: Vec<f32> = (0..1000).map(|_| (rng.next_f32() - 0.5) * spread).collect();
        let exact = log_softmax(&row);
        let q = QuantRow::from_logits(&row);
        let top = exact.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        for (i, &e) in exact.iter().enumerate() {
            let got = q.log_prob(i) as f64;
            if e > top - 16.0 + 1e-3 {
                assert!(
                    (got - e).abs() < 2e-4 + 1e-5 * e.abs(),
                    "spread {spread}, token {i}: {got} vs {e}"
                );
            } else {
                assert!(
                    got <= e + 2e-4 || (got - (top - 16.0)).abs() < 1e-3,
                    "clamped token {i}: {got} vs {e}"
                );
            }
        }
    }
    // All logits equal: every token at ln(1/V).
    let q = QuantRow::from_logits(&[3.0; 8]);
    assert!((q.log_prob(5) as f64 - (1.0f64 / 8.0).ln()).abs() < 1e-6);
}

fn header(vocab: usize, ctx: usize, chunks: usize) -> LogitsHeader {
    LogitsHeader {
        vocab,
        ctx,
        first: ctx / 2,
        chunks,
        tokenizer: [7; 16],
        tokens: random_tokens(ctx * chunks, vocab, 3),
    }
}

fn write_file(path: &Path, h: &LogitsHeader, seed: u64) -> Vec<Vec<f32>> {
    let mut w = LogitsWriter::create(path, h.clone()).unwrap();
    let mut rng = Rng::new(seed);
    let mut rows = Vec::new();
    for _ in 0..h.chunks * h.rows_per_chunk() {
        let row: Vec<f32> = (0..h.vocab).map(|_| rng.next_f32() * 10.0).collect();
        w.push_row(&row).unwrap();
        rows.push(row);
    }
    w.finish().unwrap();
    rows
}

#[test]
fn logits_files_round_trip_and_bad_ones_are_refused() {
    let h = header(50, 16, 3);
    let path = scratch("round-trip.logits");
    let rows = write_file(&path, &h, 1);
    let mut r = LogitsReader::open(&path).unwrap();
    assert_eq!(r.header, h);
    let mut got = Vec::new();
    for c in 0..3 {
        r.read_chunk(&mut got).unwrap();
        for (j, q) in got.iter().enumerate() {
            assert_eq!(q, &QuantRow::from_logits(&rows[c * 7 + j]));
        }
    }
    assert!(r.read_chunk(&mut got).is_err(), "a fourth chunk of three");
    let bytes = std::fs::read(&path).unwrap();

    let refused = |name: &str, data: &[u8], says: &str| {
        let p = scratch(name);
        std::fs::write(&p, data).unwrap();
        let e = match LogitsReader::open(&p) {
            Err(e) => e,
            Ok(mut r) => {
                let mut rows = Vec::new();
                (0..r.header.chunks)
                    .map(|_| r.read_chunk(&mut rows))
                    .find_map(|x| x.err())
                    .unwrap_or_else(|| panic!("{name}: read whole"))
            }
        };
        assert!(matches!(e, Error::SavedLogits { .. }), "{name}: {e}");
        assert!(e.to_string().contains(says), "{name}: {e}");
    };
    refused("empty", &[], "too short");
    refused(
        "magic",
        &[b"GGUF".as_slice(), &bytes[4..]].concat(),
        "no KILNLOGP",
    );
    let mut v2 = bytes.clone();
    v2[8] = 2;
    refused("version", &v2, "version 2");
    refused("truncated", &bytes[..bytes.len() - 5], "truncated");
    refused(
        "longer",
        &[bytes.as_slice(), &[0u8; 9]].concat(),
        "bytes where its header",
    );
    let mut flipped = bytes.clone();
    let at = bytes.len() - 40;
    flipped[at] ^= 0x10;
    refused("flipped", &flipped, "checksum");
    let mut token = bytes.clone();
    token[44 + 4 * 5] ^= 0x01;
    refused("token", &token, "checksum");
    // A header whose sizes claim terabytes is refused without allocating them.
    let mut huge = bytes[..44].to_vec();
    huge[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
    huge[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
    refused("huge", &huge, "overflow");

    // A writer that stops early leaves nothing under either name.
    let p = scratch("unfinished.logits");
    let mut w = LogitsWriter::create(&p, h.clone()).unwrap();
    w.push_row(&[0.0; 50]).unwrap();
    assert!(w.finish().is_err());
    assert!(!p.exists());
    let p2 = scratch("dropped.logits");
    drop(LogitsWriter::create(&p2, h).unwrap());
    assert!(!p2.exists() && !scratch("dropped.logits.partial").exists());
}

/// A model scored against its own saved logits: KLD ~0 (only the 16-bit rows' rounding),
/// the same top token everywhere, a PPL ratio of 1. The base's tokens must match.
#[test]
fn kl_divergence_from_itself_is_zero() {
    let ir = tiny_llama(32);
    let vocab = ir.config.vocab_size;
    let ctx = 64;
    let plan = Plan::new(random_tokens(3 * ctx, vocab, 8), ctx, None, Some(1)).unwrap();
    let path = scratch("self.logits");
    let mut exec = cpu_executor(&ir, ctx);
    let mut w = LogitsWriter::create(
        &path,
        LogitsHeader {
            vocab,
            ctx,
            first: plan.first(),
            chunks: plan.chunks,
            tokenizer: [0; 16],
            tokens: plan.tokens.clone(),
        },
    )
    .unwrap();
    let base = score(exec.as_mut(), &plan, Reference::Save(&mut w), |_| {}).unwrap();
    w.finish().unwrap();
    let mut r = LogitsReader::open(&path).unwrap();
    let again = score(exec.as_mut(), &plan, Reference::Compare(&mut r), |_| {}).unwrap();
    let kl = again.kl.as_ref().unwrap();
    assert!(kl.kld.mean.value.abs() < 1e-6, "{:?}", kl.kld);
    assert_eq!(kl.same_top.value, 1.0);
    assert!((kl.ppl_ratio.value - 1.0).abs() < 1e-4);
    assert!((kl.ppl_base.value / base.ppl.value - 1.0).abs() < 1e-4);
    assert!(kl.ln_ppl_correlation > 0.9999);
    assert!(kl.kld.max >= kl.kld.p99 && kl.kld.p99 >= kl.kld.median && kl.kld.median >= kl.kld.min);
    let text = kiln::perplexity::format_kl(&again, kl);
    for label in [
        "Mean    KLD:",
        "99.9%   KLD:",
        "Same top p:",
        "RMS Δp    :",
        "Mean PPL(Q)/PPL(base)",
    ] {
        assert!(text.contains(label), "{label} missing from\n{text}");
    }

    // Another run's tokens, or a longer context, are refused.
    let other = Plan::new(random_tokens(3 * ctx, vocab, 9), ctx, None, Some(1)).unwrap();
    let mut r = LogitsReader::open(&path).unwrap();
    assert!(score(exec.as_mut(), &other, Reference::Compare(&mut r), |_| {}).is_err());
}

fn kiln(args: &[&str]) -> std::process::Output {
    std::process::Command::new(kiln_binary())
        .args(args)
        .output()
        .expect("run kiln")
}

/// The CLI end to end on a synthetic SmolLM2 (its real vocabulary; random weights) and the
/// built-in text: the text and JSON reports agree, --save-logits then
/// --kl-divergence-base of a coarser quantisation prints llama.cpp's table, and bad input
/// is a clear error that leaves no file behind.
#[test]
fn cli_perplexity_save_and_kl_divergence() {
    let dir = std::env::temp_dir().join("kiln-tests-models");
    let q8 = synthetic_model(
        dir.join("smollm2.q8_0.gguf"),
        Preset::SmolLm2_135m,
        Recipe::Q8_0,
        1,
    );
    let q4 = synthetic_model(
        dir.join("smollm2.q4_0.gguf"),
        Preset::SmolLm2_135m,
        Recipe::Q4_0,
        1,
    );
    let text = scratch("genesis.txt");
    std::fs::write(&text, kiln::perplexity::SHORT_TEXT).unwrap();
    let (q8s, q4s, texts) = (
        q8.to_str().unwrap(),
        q4.to_str().unwrap(),
        text.to_str().unwrap(),
    );
    let base = scratch("base.logits");
    let bases = base.to_str().unwrap();

    let out = kiln(&[
        "perplexity",
        "-m",
        q8s,
        "-f",
        texts,
        "-c",
        "128",
        "--chunks",
        "3",
        "--save-logits",
        bases,
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.starts_with("[1]") && stdout.contains(",[3]"),
        "{stdout}"
    );
    let ppl: f64 = stdout
        .split("Final estimate: PPL = ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no final estimate in {stdout}"));
    assert!(base.is_file());

    let out = kiln(&[
        "perplexity",
        "-m",
        q8s,
        "-f",
        texts,
        "-c",
        "128",
        "--chunks",
        "3",
        "--format",
        "json",
    ]);
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let json_ppl = v["report"]["ppl"]["value"].as_f64().unwrap();
    assert!((json_ppl - ppl).abs() / ppl < 1e-4, "{json_ppl} vs {ppl}");
    assert_eq!(v["report"]["tokens_scored"], 3 * 63);

    let out = kiln(&[
        "perplexity",
        "-m",
        q4s,
        "--kl-divergence-base",
        bases,
        "--format",
        "json",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let q4_kld = v["report"]["kl"]["kld"]["mean"]["value"].as_f64().unwrap();
    let out = kiln(&["perplexity", "-m", q4s, "--kl-divergence-base", bases]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for label in ["Mean PPL(base)", "Mean    KLD:", "Same top p:"] {
        assert!(stdout.contains(label), "{label} missing:\n{stdout}");
    }
    let out = kiln(&[
        "perplexity",
        "-m",
        q8s,
        "--kl-divergence-base",
        bases,
        "--format",
        "json",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let self_kld = v["report"]["kl"]["kld"]["mean"]["value"].as_f64().unwrap();
    assert!(
        self_kld.abs() < 1e-5,
        "the base against itself: KLD {self_kld}"
    );
    // A coarser quantisation of the same weights is measurably further away.
    assert!(
        q4_kld > 1e-4 && q4_kld > 100.0 * self_kld.abs(),
        "q4 against the q8 base: KLD {q4_kld} (the base against itself {self_kld})"
    );

    // Bad input: each a clear error, exit status 1, and no logits file left.
    let empty = scratch("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let binary = scratch("binary.bin");
    std::fs::write(&binary, [0u8, 159, 146, 150, 0, 1, 2]).unwrap();
    let short = scratch("short.txt");
    std::fs::write(&short, "In the beginning.").unwrap();
    let corrupt = scratch("corrupt.logits");
    let mut bytes = std::fs::read(&base).unwrap();
    let n = bytes.len();
    bytes[n - 100] ^= 1;
    std::fs::write(&corrupt, &bytes).unwrap();
    let truncated = scratch("truncated.logits");
    std::fs::write(&truncated, &bytes[..n / 2]).unwrap();
    let out_file = scratch("never.logits");
    let outs = out_file.to_str().unwrap();
    for (args, says) in [
        (vec!["-f", empty.to_str().unwrap()], "empty"),
        (vec!["-f", binary.to_str().unwrap()], "not UTF-8"),
        (vec!["-f", short.to_str().unwrap()], "needs at least"),
        (vec!["-f", "/nonexistent/text.txt"], "No such file"),
        (vec![], "give the text"),
        (
            vec!["--kl-divergence-base", corrupt.to_str().unwrap()],
            "corrupt",
        ),
        (
            vec!["--kl-divergence-base", truncated.to_str().unwrap()],
            "truncated",
        ),
        (
            vec!["--kl-divergence-base", texts],
            "not a kiln logits file",
        ),
        (vec!["--kl-divergence-base", bases, "-c", "256"], "-c 128"),
    ] {
        let mut all = vec!["perplexity", "-m", q4s, "--save-logits", outs];
        if args.iter().any(|a| *a == "--kl-divergence-base") {
            all.truncate(3);
        }
        all.extend(args.iter().copied());
        let out = kiln(&all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{all:?}: {stderr}");
        assert!(
            stderr.contains(says),
            "{all:?}: wanted '{says}' in {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{all:?}: {stderr}");
        assert!(
            !out_file.exists() && !scratch("never.logits.partial").exists(),
            "{all:?} left a file"
        );
    }
    // A base from another vocabulary (the tiny model's file has none): refused by fingerprint.
    let mut h = LogitsReader::open(&base).unwrap().header;
    h.tokenizer = [0; 16];
    let other = scratch("other-tokenizer.logits");
    let mut w = LogitsWriter::create(&other, h.clone()).unwrap();
    for _ in 0..h.chunks * h.rows_per_chunk() {
        w.push_row(&vec![0.0; h.vocab]).unwrap();
    }
    w.finish().unwrap();
    let out = kiln(&[
        "perplexity",
        "-m",
        q4s,
        "--kl-divergence-base",
        other.to_str().unwrap(),
    ]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("another tokenizer"));
    let tok = kiln::Model::open(&q4).unwrap().tokenizer;
    assert_ne!(tokenizer_fingerprint(&tok), [0; 16]);
}
