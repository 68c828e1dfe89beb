//! Which sequence occupies which KV-cache slot, and how many tokens it holds: the
//! bookkeeping every executor needs, whatever its cache looks like. An executor keeps a
//! `SequenceSlots<MyCache>`; each slot derefs to its cache, so `slots[i].kv` reads as before.

use std::ops::{Deref, DerefMut, Index, IndexMut};

use crate::backend::SeqId;
use crate::error::{Error, Result};

/// One KV-cache slot: the sequence living in it (if any), its length and the cache itself.
#[derive(Debug)]
pub struct SeqSlot<T> {
    id: Option<SeqId>,
    /// Tokens in the cache; positions at and past it are free to overwrite.
    pub len: usize,
    pub cache: T,
}

impl<T> SeqSlot<T> {
    pub fn id(&self) -> Option<SeqId> {
        self.id
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

/// A fixed set of slots and the sequences occupying them.
#[derive(Debug)]
pub struct SequenceSlots<T> {
    slots: Vec<SeqSlot<T>>,
    next_id: SeqId,
}

impl<T> SequenceSlots<T> {
    /// One slot per cache, all free.
    pub fn new(caches: impl IntoIterator<Item = T>) -> Self {
        let slots = caches
            .into_iter()
            .map(|cache| SeqSlot {
                id: None,
                len: 0,
                cache,
            })
            .collect();
        SequenceSlots { slots, next_id: 0 }
    }

    /// Number of slots (sequences that may be alive at once).
    pub fn capacity(&self) -> usize {
        self.slots.len()
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

    /// Frees the slot of `seq`.
    pub fn free(&mut self, seq: SeqId) -> Result<()> {
        let slot = self.index_of(seq)?;
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

    /// Forgets the positions of `seq` from `len` on. Attention reads only positions below
    /// the length, so the cache itself needs no clearing.
    pub fn truncate(&mut self, seq: SeqId, len: usize) -> Result<()> {
        let slot = self.index_of(seq)?;
        let cur = self.slots[slot].len;
        if len > cur {
            return Err(Error::InvalidArgument(format!(
                "cannot truncate sequence {seq} of {cur} tokens to {len}"
            )));
        }
        self.slots[slot].len = len;
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
        let mut s = SequenceSlots::new([(), ()]);
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
}
