//! SentencePiece BPE by scores, as llama.cpp's SPM tokenizer runs it.
//!
//! The text is cut into UTF-8 characters; the adjacent pair whose concatenation is a vocab
//! token with the highest score is merged first (ties go to the leftmost pair), until no
//! pair forms a token. Symbols that are not tokens fall back to `<0xXX>` byte tokens.
//! The `tokenizers` crate's BPE model merges by rank from an explicit merge list, which a
//! SentencePiece GGUF does not carry, so the merge loop lives here.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use kiln_core::{Error, Result};

/// A run of text bytes in the linked list of live symbols. `len == 0` marks a symbol that
/// was merged into its left neighbour.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    /// Byte length of the pair when it was queued; a later merge of either side changes
    /// it, which is how stale entries are recognised without removing them from the heap.
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    /// Max-heap order: higher score first, then the leftmost pair.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

/// The vocabulary view the merge loop needs.
pub(super) struct SpmVocab<'a> {
    pub token_to_id: &'a HashMap<String, u32>,
    pub scores: &'a [f32],
    /// Token for each byte value, for characters no token covers.
    pub byte_tokens: &'a [Option<u32>; 256],
    pub unk: Option<u32>,
}

/// Tokenizes `text`, which must already have spaces escaped to `▁`, appending ids to `out`.
pub(super) fn tokenize(vocab: &SpmVocab<'_>, text: &str, out: &mut Vec<u32>) -> Result<()> {
    if text.is_empty() {
        return Ok(());
    }
    let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
    for (i, (start, ch)) in text.char_indices().enumerate() {
        symbols.push(Symbol {
            start,
            len: ch.len_utf8(),
            prev: i.checked_sub(1),
            next: None,
        });
    }
    let n = symbols.len();
    for (i, sym) in symbols.iter_mut().enumerate() {
        sym.next = (i + 1 < n).then_some(i + 1);
    }

    let mut heap = BinaryHeap::new();
    let try_add = |heap: &mut BinaryHeap<Bigram>,
                   symbols: &[Symbol],
                   left: Option<usize>,
                   right: Option<usize>| {
        let (Some(left), Some(right)) = (left, right) else {
            return;
        };
        let (l, r) = (symbols[left], symbols[right]);
        let piece = &text[l.start..r.start + r.len];
        if let Some(&id) = vocab.token_to_id.get(piece) {
            let score = vocab.scores.get(id as usize).copied().unwrap_or(0.0);
            heap.push(Bigram {
                score,
                left,
                right,
                size: piece.len(),
            });
        }
    };
    for i in 1..n {
        try_add(&mut heap, &symbols, Some(i - 1), Some(i));
    }

    while let Some(bigram) = heap.pop() {
        let (l, r) = (symbols[bigram.left], symbols[bigram.right]);
        if l.len == 0 || r.len == 0 || l.len + r.len != bigram.size {
            continue;
        }
        symbols[bigram.left].len += r.len;
        symbols[bigram.right].len = 0;
        symbols[bigram.left].next = r.next;
        if let Some(next) = r.next {
            symbols[next].prev = Some(bigram.left);
        }
        try_add(&mut heap, &symbols, l.prev, Some(bigram.left));
        try_add(&mut heap, &symbols, Some(bigram.left), r.next);
    }

    let mut cursor = Some(0);
    while let Some(i) = cursor {
        let sym = symbols[i];
        cursor = sym.next;
        if sym.len == 0 {
            continue;
        }
        let piece = &text[sym.start..sym.start + sym.len];
        if let Some(&id) = vocab.token_to_id.get(piece) {
            out.push(id);
            continue;
        }
        for &b in piece.as_bytes() {
            match vocab.byte_tokens[b as usize].or(vocab.unk) {
                Some(id) => out.push(id),
                None => {
                    return Err(Error::Tokenizer(format!(
                        "no token for byte 0x{b:02X} (no <0x{b:02X}> token and no unknown token)"
                    )))
                }
            }
        }
    }
    Ok(())
}
