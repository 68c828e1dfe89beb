//! Which sequence occupies which slot, how many tokens it holds, and which blocks of the
//! paged KV cache hold them: the bookkeeping every executor needs, whatever its cache looks
//! like. An executor keeps a `SequenceSlots<MyCache>`; each slot derefs to its cache, so
//! `slots[i].kv` reads as before.
//!
//! The KV cache of the layers that attend to the whole context is a pool of blocks of
//! [`KV_BLOCK_TOKENS`] positions, shared by all sequences: a sequence holds the blocks its
//! length needs, in order (its block table: position p lives in block `blocks()[p / 32]`,
//! row p % 32), takes more as it grows ([`SequenceSlots::reserve`]) and gives them back when
//! it is truncated or freed. So many short sequences and a few long ones share one
//! allocation, as vLLM's paged attention does. A slot is what a sequence needs besides:
//! its id, and the per-sequence state an executor keeps (a sliding-window layer's ring of
//! a fixed size, a decode graph).

use std::ops::{Deref, DerefMut, Index, IndexMut};

use crate::backend::SeqId;
use crate::error::{Error, Result};

/// Positions one KV block holds. 32: a warp of the GPU attention kernels takes 32
/// positions at a time (one block-table entry each), and a q8_0 row's scales stay whole.
pub const KV_BLOCK_TOKENS: usize = 32;

/// How full a paged KV cache is: what `kiln bench` and the server's metrics report, and
/// what a scheduler admits requests by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvBlockUsage {
    /// Positions a block holds ([`KV_BLOCK_TOKENS`]).
    pub block_tokens: usize,
    /// Blocks in the pool.
    pub total: usize,
    /// Blocks no sequence holds.
    pub free: usize,
    /// Bytes one block takes (keys and values of every paged layer).
    pub block_bytes: usize,
}

impl KvBlockUsage {
    /// Blocks a sequence of `tokens` positions holds.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_tokens)
    }

    /// Blocks some sequence holds.
    pub fn in_use(&self) -> usize {
        self.total - self.free
    }
}

/// One slot: the sequence living in it (if any), its length, the KV blocks it holds and
/// the executor's per-sequence state.
#[derive(Debug)]
pub struct SeqSlot<T> {
    id: Option<SeqId>,
    /// Tokens in the cache; positions at and past it are free to overwrite.
    pub len: usize,
    /// The sequence's block table: position p lives in block `blocks[p / KV_BLOCK_TOKENS]`.
    blocks: Vec<u32>,
    pub cache: T,
}

impl<T> SeqSlot<T> {
    pub fn id(&self) -> Option<SeqId> {
        self.id
    }

    /// The sequence's block table (empty for a free slot).
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    /// Positions the blocks the sequence holds have room for.
    pub fn capacity(&self) -> usize {
        self.blocks.len() * KV_BLOCK_TOKENS
    }
}

impl<T> Deref for SeqSlot<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.cache
    }
}

impl<T> DerefMut for SeqSlot<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.cache
    }
}

/// A fixed set of slots, the sequences occupying them and the pool of KV blocks they share.
#[derive(Debug)]
pub struct SequenceSlots<T> {
    slots: Vec<SeqSlot<T>>,
    next_id: SeqId,
    /// Blocks no sequence holds; taken from the end, so the lowest come first.
    free_blocks: Vec<u32>,
    total_blocks: usize,
    /// Blocks one sequence may hold: its context limit's.
    max_blocks: usize,
}

impl<T> SequenceSlots<T> {
    /// One slot per cache, all free, sharing a pool of `blocks` KV blocks; a sequence holds
    /// at most `max_context` positions' worth.
    pub fn new(caches: impl IntoIterator<Item = T>, blocks: usize, max_context: usize) -> Self {
        let slots = caches
            .into_iter()
            .map(|cache| SeqSlot {
                id: None,
                len: 0,
                blocks: Vec::new(),
                cache,
            })
            .collect();
        let blocks = blocks.min(u32::MAX as usize);
        SequenceSlots {
            slots,
            next_id: 0,
            free_blocks: (0..blocks as u32).rev().collect(),
            total_blocks: blocks,
            max_blocks: max_context.div_ceil(KV_BLOCK_TOKENS),
        }
    }

    /// Number of slots (sequences that may be alive at once).
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Blocks one sequence may hold (its context limit's): the length of a block-table row.
    pub fn max_blocks(&self) -> usize {
        self.max_blocks
    }

    /// Blocks in the pool, and those no sequence holds.
    pub fn block_counts(&self) -> (usize, usize) {
        (self.total_blocks, self.free_blocks.len())
    }

    /// Makes the sequence in `slot` hold blocks for positions `0..len`, taking what it
    /// lacks from the pool. `Ok(true)` when its block table changed (an executor that keeps
    /// a copy of it on a device updates that). [`Error::KvCacheFull`] when the pool has too
    /// few free blocks: then nothing changes.
    pub fn reserve(&mut self, slot: usize, len: usize) -> Result<bool> {
        let need = len.div_ceil(KV_BLOCK_TOKENS);
        let s = &mut self.slots[slot];
        if s.id.is_none() {
            return Err(Error::InvalidArgument(format!(
                "slot {slot} holds no sequence"
            )));
        }
        if need > self.max_blocks {
            return Err(Error::InvalidArgument(format!(
                "{len} positions pass the context limit of {} blocks of {KV_BLOCK_TOKENS}",
                self.max_blocks
            )));
        }
        let more = need.saturating_sub(s.blocks.len());
        if more == 0 {
            return Ok(false);
        }
        if more > self.free_blocks.len() {
            return Err(Error::KvCacheFull {
                needed: more,
                free: self.free_blocks.len(),
                total: self.total_blocks,
            });
        }
        let at = self.free_blocks.len() - more;
        s.blocks.extend(self.free_blocks.drain(at..).rev());
        Ok(true)
    }

    /// [`SequenceSlots::reserve`] for several sequences at once (`(slot, len)` each, slots
    /// distinct), all or nothing: the pool's free blocks are counted against the whole
    /// batch's need first, so a refused batch takes no block. Returns the slots whose block
    /// tables changed.
    pub fn reserve_all(&mut self, wants: &[(usize, usize)]) -> Result<Vec<usize>> {
        let mut more = 0usize;
        for &(slot, len) in wants {
            let s = self.slots.get(slot).ok_or_else(|| {
                Error::InvalidArgument(format!("slot {slot} of {}", self.slots.len()))
            })?;
            let need = len.div_ceil(KV_BLOCK_TOKENS);
            if s.id.is_none() || need > self.max_blocks {
                // reserve() names the problem.
                return self.reserve(slot, len).map(|_| Vec::new());
            }
            more += need.saturating_sub(s.blocks.len());
        }
        if more > self.free_blocks.len() {
            return Err(Error::KvCacheFull {
                needed: more,
                free: self.free_blocks.len(),
                total: self.total_blocks,
            });
        }
        let mut changed = Vec::new();
        for &(slot, len) in wants {
            if self.reserve(slot, len)? {
                changed.push(slot);
            }
        }
        Ok(changed)
    }

    /// Gives back the blocks of `slot` past those positions `0..len` need.
    fn release(&mut self, slot: usize, len: usize) {
        let keep = len.div_ceil(KV_BLOCK_TOKENS);
        let s = &mut self.slots[slot];
        if s.blocks.len() > keep {
            self.free_blocks.extend(s.blocks.drain(keep..).rev());
        }
    }

    /// Puts a new, empty sequence in a free slot. Ids are not reused while alive.
    pub fn allocate(&mut self) -> Result<SeqId> {
        let Some(slot) = self.slots.iter().position(|s| s.id.is_none()) else {
            return Err(Error::InvalidArgument(format!(
                "all {} sequence slots are in use",
                self.slots.len()
            )));
        };
        let mut id = self.next_id;
        while self.slots.iter().any(|s| s.id == Some(id)) {
            id = id.wrapping_add(1);
        }
        self.next_id = id.wrapping_add(1);
        self.slots[slot].id = Some(id);
        self.slots[slot].len = 0;
        Ok(id)
    }

    /// Frees the slot of `seq` and the KV blocks it held.
    pub fn free(&mut self, seq: SeqId) -> Result<()> {
        let slot = self.index_of(seq)?;
        self.release(slot, 0);
        self.slots[slot].id = None;
        self.slots[slot].len = 0;
        Ok(())
    }

    /// The slot `seq` lives in.
    pub fn index_of(&self, seq: SeqId) -> Result<usize> {
        self.slots
            .iter()
            .position(|s| s.id == Some(seq))
            .ok_or_else(|| Error::InvalidArgument(format!("unknown sequence {seq}")))
    }

    /// Tokens in the cache of `seq`.
    pub fn len_of(&self, seq: SeqId) -> Result<usize> {
        Ok(self.slots[self.index_of(seq)?].len)
    }

    /// Forgets the positions of `seq` from `len` on, giving back the blocks that held only
    /// them. Attention reads only positions below the length, so the cache itself needs no
    /// clearing.
    pub fn truncate(&mut self, seq: SeqId, len: usize) -> Result<()> {
        let slot = self.index_of(seq)?;
        let cur = self.slots[slot].len;
        if len > cur {
            return Err(Error::InvalidArgument(format!(
                "cannot truncate sequence {seq} of {cur} tokens to {len}"
            )));
        }
        self.slots[slot].len = len;
        self.release(slot, len);
        Ok(())
    }

    pub fn as_slice(&self) -> &[SeqSlot<T>] {
        &self.slots
    }

    pub fn as_mut_slice(&mut self) -> &mut [SeqSlot<T>] {
        &mut self.slots
    }
}

impl<T> Index<usize> for SequenceSlots<T> {
    type Output = SeqSlot<T>;
    fn index(&self, slot: usize) -> &SeqSlot<T> {
        &self.slots[slot]
    }
}

impl<T> IndexMut<usize> for SequenceSlots<T> {
    fn index_mut(&mut self, slot: usize) -> &mut SeqSlot<T> {
        &mut self.slots[slot]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_free_truncate() {
        let mut s = SequenceSlots::new([(), ()], 4, 64);
        let a = s.allocate().unwrap();
        let b = s.allocate().unwrap();
        assert_ne!(a, b);
        assert!(
            matches!(s.allocate(), Err(Error::InvalidArgument(_))),
            "both slots are taken"
        );
        let slot = s.index_of(a).unwrap();
        s[slot].len = 5;
        s.truncate(a, 3).unwrap();
        assert_eq!(s.len_of(a).unwrap(), 3);
        assert!(s.truncate(a, 4).is_err(), "truncate cannot grow");
        s.free(a).unwrap();
        assert!(s.len_of(a).is_err());
        let c = s.allocate().unwrap();
        assert!(c != a && c != b, "ids are not reused at once");
        assert_eq!(s.len_of(c).unwrap(), 0);
    }

    #[test]
    fn blocks_come_from_the_pool_and_go_back() {
        let mut s = SequenceSlots::new([(), (), ()], 5, 96);
        assert_eq!(s.max_blocks(), 3);
        let a = s.allocate().unwrap();
        let b = s.allocate().unwrap();
        let (ia, ib) = (s.index_of(a).unwrap(), s.index_of(b).unwrap());
        assert!(s.reserve(ia, 33).unwrap(), "two blocks taken");
        assert!(!s.reserve(ia, 64).unwrap(), "64 positions fit the same two");
        assert_eq!(s[ia].blocks(), &[0, 1]);
        assert_eq!(s[ia].capacity(), 64);
        assert!(s.reserve(ib, 96).unwrap());
        assert_eq!(s[ib].blocks(), &[2, 3, 4]);
        assert_eq!(s.block_counts(), (5, 0));
        // The pool is empty: a refusal that changes nothing.
        match s.reserve(ia, 65) {
            Err(Error::KvCacheFull {
                needed: 1,
                free: 0,
                total: 5,
            }) => {}
            other => panic!("{other:?}"),
        }
        assert_eq!(s[ia].blocks(), &[0, 1]);
        assert!(
            matches!(s.reserve(ib, 97), Err(Error::InvalidArgument(_))),
            "past the context limit"
        );
        // Truncation keeps the blocks the kept positions need.
        s[ib].len = 96;
        s.truncate(b, 40).unwrap();
        assert_eq!(s[ib].blocks(), &[2, 3]);
        assert_eq!(s.block_counts(), (5, 1));
        s.free(a).unwrap();
        assert_eq!(s.block_counts(), (5, 3));
        let c = s.allocate().unwrap();
        let ic = s.index_of(c).unwrap();
        assert!(s.reserve(ic, 96).unwrap());
        let mut held: Vec<u32> = [ib, ic]
            .iter()
            .flat_map(|&i| s[i].blocks().to_vec())
            .collect();
        held.sort();
        assert_eq!(held, [0, 1, 2, 3, 4], "no block held twice");
        // A batch is reserved whole or not at all.
        s.free(c).unwrap();
        let d = s.allocate().unwrap();
        let id = s.index_of(d).unwrap();
        assert!(matches!(
            s.reserve_all(&[(id, 96), (ib, 96)]),
            Err(Error::KvCacheFull {
                needed: 4,
                free: 3,
                total: 5
            })
        ));
        assert_eq!(s.block_counts(), (5, 3), "a refused batch takes nothing");
        assert_eq!(s.reserve_all(&[(id, 64), (ib, 96)]).unwrap(), vec![id, ib]);
        assert_eq!(s.block_counts(), (5, 0));
    }
}
