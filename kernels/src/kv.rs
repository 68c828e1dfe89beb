//! The KV cache of an executor: f16 keys and values per layer for a fixed number of
//! sequence slots, laid out `[slot][kv_head][position][head_dim]` in one allocation per
//! layer, so one head's history is contiguous for the attention kernel and a batched step
//! reaches any slot's cache as `base + slot · slot_stride`.
//!
//! A layer keeps `rows` positions per KV head: the context, or for a sliding-window layer
//! only a ring of the window plus one prefill chunk (position p in row p % rows), which is
//! what Gemma 3's five local layers in six need.

use std::sync::Arc;

use crate::buffer::{DevSlice, DeviceBuffer};
use crate::device::Device;
use crate::error::{KernelError, Result};

pub struct KvCache {
    pub slots: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Positions each layer keeps per KV head and slot.
    rows: Vec<usize>,
    k: Vec<DeviceBuffer<u16>>,
    v: Vec<DeviceBuffer<u16>>,
}

impl KvCache {
    /// Allocates the cache for `slots` sequences, layer l keeping `rows[l]` positions
    /// (contents undefined until written).
    pub fn new(
        device: &Arc<Device>,
        slots: usize,
        kv_heads: usize,
        head_dim: usize,
        rows: &[usize],
    ) -> Result<Self> {
        if slots == 0 || rows.is_empty() || kv_heads == 0 || head_dim == 0 || rows.contains(&0) {
            return Err(KernelError::InvalidArgument(
                "KV cache with a zero dimension".into(),
            ));
        }
        let mut k = Vec::with_capacity(rows.len());
        let mut v = Vec::with_capacity(rows.len());
        for &r in rows {
            let per = kv_heads
                .checked_mul(r)
                .and_then(|n| n.checked_mul(head_dim))
                .and_then(|n| n.checked_mul(slots))
                .ok_or_else(|| KernelError::InvalidArgument("KV cache size overflows".into()))?;
            k.push(DeviceBuffer::alloc(device, per)?);
            v.push(DeviceBuffer::alloc(device, per)?);
        }
        Ok(KvCache {
            slots,
            kv_heads,
            head_dim,
            rows: rows.to_vec(),
            k,
            v,
        })
    }

    /// Layers the cache holds.
    pub fn layers(&self) -> usize {
        self.rows.len()
    }

    /// Bytes the cache occupies on the device.
    pub fn bytes(&self) -> usize {
        (0..self.layers())
            .map(|l| 2 * self.slots * self.slot_stride(l) * 2)
            .sum()
    }

    /// Bytes of K and V one token of context takes over all layers (while a sliding-window
    /// layer's ring is filling; past it, only the full layers grow).
    pub fn bytes_per_token(&self) -> usize {
        2 * self.layers() * self.kv_heads * self.head_dim * 2
    }

    /// Positions `layer` keeps per KV head and slot (0 for a layer out of range).
    pub fn rows(&self, layer: usize) -> usize {
        self.rows.get(layer).copied().unwrap_or(0)
    }

    /// Halves from one slot's cache to the next within `layer`.
    pub fn slot_stride(&self, layer: usize) -> usize {
        self.kv_heads * self.rows(layer) * self.head_dim
    }

    /// (keys, values) of `layer` for the sequence in `slot`.
    pub fn layer(&self, layer: usize, slot: usize) -> Result<(DevSlice<u16>, DevSlice<u16>)> {
        let (k, v) = self.layer_all(layer)?;
        if slot >= self.slots {
            return Err(KernelError::InvalidArgument(format!(
                "slot {slot} of a {}-slot cache",
                self.slots
            )));
        }
        let n = self.slot_stride(layer);
        Ok((k.sub(slot * n, n)?, v.sub(slot * n, n)?))
    }

    /// (keys, values) of `layer` for every slot (the batched step's view).
    pub fn layer_all(&self, layer: usize) -> Result<(DevSlice<u16>, DevSlice<u16>)> {
        match (self.k.get(layer), self.v.get(layer)) {
            (Some(k), Some(v)) => Ok((k.slice(), v.slice())),
            _ => Err(KernelError::InvalidArgument(format!(
                "layer {layer} of a {}-layer cache",
                self.layers()
            ))),
        }
    }
}
