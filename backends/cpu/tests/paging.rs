//! The paged KV cache: sequences take 32-position blocks from one pool as they grow, so a
//! pool smaller than every sequence's full context serves them; blocks of two sequences
//! interleave in the pool without either seeing the other's rows; a call the pool has no
//! room for fails with `KvCacheFull` and changes nothing; truncation and freeing give
//! blocks back.

mod common;

use common::Spec;
use kiln_backend_cpu::CpuBackend;
use kiln_core::{
    Backend, DecodeItem, Error, KvBlockUsage, KvType, LayerExecutor, LoadOptions, ModelIr, SeqId,
};

const CONTEXT: usize = 128;

fn options(kind: KvType, sequences: usize, kv_memory: Option<u64>) -> LoadOptions {
    LoadOptions {
        max_context: CONTEXT,
        max_sequences: sequences,
        threads: Some(2),
        kv_type: Some(kind),
        kv_memory,
        ..Default::default()
    }
}

fn usage(ex: &dyn LayerExecutor) -> KvBlockUsage {
    ex.kv_blocks().expect("the CPU executor pages its cache")
}

/// Bytes one block takes for `kind` (from an executor with the default pool).
fn block_bytes(ir: &ModelIr, kind: KvType) -> u64 {
    let ex = CpuBackend.load(ir, &options(kind, 1, None)).unwrap();
    usage(ex.as_ref()).block_bytes as u64
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum();
    let n = |v: &[f32]| v.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (n(a) * n(b))
}

fn tokens(n: usize, vocab: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed * 7919) >> 9) % vocab as u32)
        .collect()
}

/// A sequence and the tokens it holds.
struct Tracked {
    seq: SeqId,
    history: Vec<u32>,
}

/// The logits of `history` run alone on a fresh executor (its blocks one after another).
fn alone(ir: &ModelIr, kind: KvType, history: &[u32]) -> Vec<f32> {
    let mut ex = CpuBackend.load(ir, &options(kind, 1, None)).unwrap();
    let seq = ex.new_sequence().unwrap();
    let mut logits = vec![0.0; ir.config.vocab_size];
    ex.prefill(seq, history, &mut logits).unwrap();
    logits
}

/// Decodes `token` on `s` and checks the logits against its history replayed alone.
fn step_and_check(
    ex: &mut dyn LayerExecutor,
    ir: &ModelIr,
    kind: KvType,
    s: &mut Tracked,
    token: u32,
    what: &str,
) {
    let mut got = vec![0.0; ir.config.vocab_size];
    ex.decode(&[DecodeItem { seq: s.seq, token }], &mut got)
        .unwrap();
    s.history.push(token);
    let want = alone(ir, kind, &s.history);
    let cos = cosine(&got, &want);
    assert!(
        cos >= 0.99999,
        "{what} ({kind}): cosine {cos} to the history of {} alone",
        s.history.len()
    );
}

/// Grows `s` by `n` tokens one decode step at a time.
fn grow(ex: &mut dyn LayerExecutor, s: &mut Tracked, n: usize, seed: u32) {
    let vocab = ex.config().vocab_size;
    let mut logits = vec![0.0; vocab];
    for t in tokens(n, vocab, seed) {
        ex.decode(
            &[DecodeItem {
                seq: s.seq,
                token: t,
            }],
            &mut logits,
        )
        .unwrap();
        s.history.push(t);
    }
}

fn prefilled(ex: &mut dyn LayerExecutor, n: usize, seed: u32) -> Tracked {
    let vocab = ex.config().vocab_size;
    let seq = ex.new_sequence().unwrap();
    let history = tokens(n, vocab, seed);
    let mut logits = vec![0.0; vocab];
    ex.prefill(seq, &history, &mut logits).unwrap();
    Tracked { seq, history }
}

/// Two sequences that grow in turns hold interleaved blocks of a pool smaller than three
/// sequences' contexts; each computes what it computes alone. Then the pool is full: a
/// prompt, a decode batch and a prefill past a sequence's blocks are refused with
/// `KvCacheFull` and change nothing; truncating and freeing give blocks back.
fn interleave(spec: Spec, kind: KvType) {
    let ir = spec.build(11);
    let vocab = ir.config.vocab_size;
    let per_seq = CONTEXT / 32;
    // Room for six blocks: a context and a half, for three sequences.
    let mem = 6 * block_bytes(&ir, kind);
    let mut ex = CpuBackend.load(&ir, &options(kind, 3, Some(mem))).unwrap();
    let u = usage(ex.as_ref());
    assert_eq!((u.block_tokens, u.total, u.free), (32, 6, 6), "{kind}");
    assert!(u.total < 3 * per_seq);

    let ex = ex.as_mut();
    // A takes block 0, B blocks 1 and 2, A block 3 as they grow in turns.
    let mut a = prefilled(ex, 20, 1);
    let mut b = prefilled(ex, 40, 2);
    grow(ex, &mut a, 20, 3);
    grow(ex, &mut b, 24, 4);
    grow(ex, &mut a, 24, 5);
    assert_eq!((a.history.len(), b.history.len()), (64, 64));
    assert_eq!(usage(ex).free, 2);
    step_and_check(ex, &ir, kind, &mut a, 17, "A across blocks 0, 3, 4");
    step_and_check(ex, &ir, kind, &mut b, 29, "B across blocks 1, 2, 5");
    assert_eq!(usage(ex).free, 0, "A and B took the last two blocks");
    for i in 0..5 {
        step_and_check(ex, &ir, kind, &mut a, 3 + i, "A");
        step_and_check(ex, &ir, kind, &mut b, 40 + i, "B");
    }

    // The pool is empty. A prompt for a new sequence: refused, the sequence stays empty.
    let c = ex.new_sequence().unwrap();
    let mut logits = vec![0.0; vocab];
    match ex.prefill(c, &tokens(5, vocab, 6), &mut logits) {
        Err(Error::KvCacheFull {
            needed: 1,
            free: 0,
            total: 6,
        }) => {}
        other => panic!("{kind}: a prompt with no block left: {other:?}"),
    }
    assert_eq!(ex.sequence_len(c).unwrap(), 0);
    // B grows to the end of its third block; a batch of A and B then needs one block for B:
    // refused whole, A's step included.
    let more = 96 - b.history.len();
    grow(ex, &mut b, more, 7);
    let lens = (a.history.len(), b.history.len());
    let mut two = vec![0.0; 2 * vocab];
    let batch = [
        DecodeItem {
            seq: a.seq,
            token: 1,
        },
        DecodeItem {
            seq: b.seq,
            token: 2,
        },
    ];
    match ex.decode(&batch, &mut two) {
        Err(Error::KvCacheFull {
            needed: 1, free: 0, ..
        }) => {}
        other => panic!("{kind}: a decode batch with no block left: {other:?}"),
    }
    assert_eq!(
        (
            ex.sequence_len(a.seq).unwrap(),
            ex.sequence_len(b.seq).unwrap()
        ),
        lens,
        "{kind}: a refused batch changes no length"
    );
    // A prompt on A past its blocks: refused whole.
    let past = 96 - a.history.len() + 1;
    assert!(matches!(
        ex.prefill(a.seq, &tokens(past, vocab, 8), &mut logits),
        Err(Error::KvCacheFull { .. })
    ));
    assert_eq!(ex.sequence_len(a.seq).unwrap(), lens.0);
    assert_eq!(usage(ex).free, 0);
    // Nothing of the refused calls shows: both still compute their histories alone.
    step_and_check(ex, &ir, kind, &mut a, 9, "A after refusals");

    // Truncation keeps the kept positions' rows and gives the rest back.
    ex.truncate_sequence(b.seq, 33).unwrap();
    b.history.truncate(33);
    assert_eq!(
        usage(ex).free,
        1,
        "B keeps blocks 1, 2 for its 33 positions"
    );
    step_and_check(ex, &ir, kind, &mut b, 11, "B truncated to 33");
    step_and_check(ex, &ir, kind, &mut a, 12, "A after B's truncation");
    let mut logits = vec![0.0; vocab];
    ex.prefill(c, &tokens(30, vocab, 9), &mut logits).unwrap();
    assert_eq!(usage(ex).free, 0, "C took B's block");
    let mut c = Tracked {
        seq: c,
        history: tokens(30, vocab, 9),
    };
    step_and_check(ex, &ir, kind, &mut c, 13, "C in B's old block");
    for s in [a.seq, b.seq, c.seq] {
        ex.free_sequence(s).unwrap();
    }
    assert_eq!(usage(ex).free, 6, "{kind}: every block back");
}

#[test]
fn interleaved_blocks_keep_sequences_apart_f32() {
    interleave(Spec::llama(), KvType::F32);
}

#[test]
fn interleaved_blocks_keep_sequences_apart_f16() {
    interleave(Spec::llama(), KvType::F16);
}

/// Gemma 3's windowed layers keep their rings beside the paged global layer; q8_0 rows of
/// its 32-value heads.
#[test]
fn interleaved_blocks_keep_sequences_apart_with_windowed_layers() {
    interleave(Spec::gemma3(), KvType::F32);
    interleave(Spec::gemma3(), KvType::Q8_0);
}

#[test]
fn the_pool_holds_at_least_one_context() {
    let ir = Spec::llama().build(3);
    let block = block_bytes(&ir, KvType::F32);
    let per_seq = (CONTEXT / 32) as u64;
    // A context less one byte: refused at load.
    match CpuBackend.load(&ir, &options(KvType::F32, 4, Some(per_seq * block - 1))) {
        Err(Error::OutOfMemory(m)) => assert!(m.contains("--kv-mem"), "{m}"),
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("a pool smaller than one context loaded"),
    }
    // One context: four sequences share it.
    let ex = CpuBackend
        .load(&ir, &options(KvType::F32, 4, Some(per_seq * block)))
        .unwrap();
    assert_eq!(usage(ex.as_ref()).total, per_seq as usize);
    // The default, and more memory than every context: every sequence's full context.
    for mem in [None, Some(100 * per_seq * block)] {
        let ex = CpuBackend.load(&ir, &options(KvType::F32, 4, mem)).unwrap();
        let u = usage(ex.as_ref());
        assert_eq!(
            (u.total, u.free),
            (4 * per_seq as usize, 4 * per_seq as usize)
        );
    }
    // What a block takes: 32 rows of keys and values of both layers.
    let c = &ir.config;
    assert_eq!(block as usize, 2 * c.num_layers * 32 * c.kv_dim() * 4);
}

/// A sequence that reaches the full context in a pool of exactly one context, and a
/// decode batch that one refused item keeps from running at all.
#[test]
fn one_context_pool_runs_a_full_sequence() {
    let ir = Spec::llama().build(5);
    let vocab = ir.config.vocab_size;
    let block = block_bytes(&ir, KvType::F32);
    let mut ex = CpuBackend
        .load(&ir, &options(KvType::F32, 2, Some(4 * block)))
        .unwrap();
    let ex = ex.as_mut();
    let mut a = prefilled(ex, 100, 1);
    let more = CONTEXT - 1 - a.history.len();
    grow(ex, &mut a, more, 2);
    step_and_check(ex, &ir, KvType::F32, &mut a, 5, "A at the full context");
    assert_eq!(usage(ex).free, 0);
    let b = ex.new_sequence().unwrap();
    let mut logits = vec![0.0; vocab];
    assert!(matches!(
        ex.decode(&[DecodeItem { seq: b, token: 0 }], &mut logits),
        Err(Error::KvCacheFull {
            needed: 1,
            free: 0,
            total: 4
        })
    ));
    assert_eq!(ex.sequence_len(b).unwrap(), 0);
    ex.free_sequence(a.seq).unwrap();
    ex.decode(&[DecodeItem { seq: b, token: 0 }], &mut logits)
        .unwrap();
    assert_eq!(usage(ex).free, 3);
}
