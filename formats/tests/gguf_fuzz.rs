//! Property test: random byte corruptions and truncations of a valid GGUF file never make
//! the reader panic, and never make it allocate more than a small multiple of the file.
//!
//! This file holds a single test so the counting allocator below measures only the parser.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use kiln_core::QType;
use kiln_formats::gguf::{GgufArray, GgufFile, GgufWriter};
use proptest::prelude::*;

/// Tracks live and peak heap bytes.
struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn valid_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "llama").unwrap();
    w.add_kv("general.alignment", 64u32).unwrap();
    w.add_kv("llama.block_count", 2u32).unwrap();
    w.add_kv("llama.rope.freq_base", 10000.0f32).unwrap();
    w.add_kv("tokenizer.ggml.tokens", vec!["<s>", "</s>", "a", "b", "ab"])
        .unwrap();
    w.add_kv("tokenizer.ggml.scores", vec![0.0f32, 0.0, -1.0, -2.0, -3.0])
        .unwrap();
    w.add_kv("tokenizer.ggml.token_type", vec![3i32, 3, 1, 1, 1])
        .unwrap();
    w.add_kv(
        "nested",
        GgufArray::Array(vec![
            GgufArray::U64(vec![1, 2]),
            GgufArray::String(vec!["x".into()]),
        ]),
    )
    .unwrap();
    w.add_kv("flag", true).unwrap();
    w.add_kv("big", u64::MAX).unwrap();
    w.add_tensor(
        "token_embd.weight",
        QType::Q8_0,
        vec![32, 5],
        vec![3; 34 * 5],
    )
    .unwrap();
    w.add_tensor("output_norm.weight", QType::F32, vec![32], vec![0; 128])
        .unwrap();
    w.add_tensor(
        "blk.0.attn_q.weight",
        QType::Q4_K,
        vec![256, 2],
        vec![7; 288],
    )
    .unwrap();
    w.write_to(Vec::new()).unwrap()
}

/// Where to corrupt: anywhere, but mostly the header and metadata where the structure is.
fn corruption(len: usize) -> impl Strategy<Value = (Vec<(usize, u8)>, Option<usize>)> {
    let header_end = (len / 2).max(1);
    let pos = prop_oneof![3 => 0..header_end, 1 => 0..len];
    let byte = prop_oneof![any::<u8>(), Just(0u8), Just(0xFF), Just(0x7F), Just(0x80)];
    (
        proptest::collection::vec((pos, byte), 1..8),
        proptest::option::weighted(0.3, 0..len),
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn corrupted_files_never_panic_or_balloon((edits, truncate) in corruption(valid_file().len())) {
        let mut bytes = valid_file();
        for (i, b) in edits {
            bytes[i] = b;
        }
        if let Some(n) = truncate {
            bytes.truncate(n);
        }
        let file_len = bytes.len();
        let storage = Arc::new(bytes);

        let before = LIVE.load(Ordering::Relaxed);
        PEAK.store(before, Ordering::Relaxed);
        let parsed = GgufFile::from_storage(storage);
        let grown = PEAK.load(Ordering::Relaxed) - before;
        // Strings and arrays are bounded by the bytes that hold them; the constant covers the
        // hash indexes and small vectors of an empty file.
        prop_assert!(grown <= 8 * file_len + 64 * 1024, "parsing {file_len} bytes allocated {grown}");

        if let Ok(f) = parsed {
            // Whatever parsed must be usable: every tensor views without error.
            for t in f.tensors() {
                let v = f.view(t).expect("a parsed tensor must be viewable");
                prop_assert_eq!(v.bytes().len(), t.n_bytes);
            }
            for (k, _) in f.metadata() {
                prop_assert!(f.get(k).is_some());
            }
        }
    }
}
