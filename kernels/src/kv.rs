//! The KV cache of an executor: f16 keys and values per layer for a fixed number of
//! sequence slots, laid out `[slot][kv_head][position][head_dim]` in one allocation per
//! layer, so one head's history is contiguous for the attention kernel and a batched step
//! reaches any slot's cache as `base + slot · slot_stride`.

use std::sync::Arc;

use crate::buffer::{DevSlice, DeviceBuffer};
use crate::device::Device;
use crate::error::{KernelError, Result};

pub struct KvCache {
    pub slots: usize,
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub max_ctx: usize,
    k: Vec<DeviceBuffer<u16>>,
    v: Vec<DeviceBuffer<u16>>,
}

impl KvCache {
    /// Allocates the cache for `slots` sequences of up to `max_ctx` tokens (contents
    /// undefined until written).
    pub fn new(
        device: &Arc<Device>,
        slots: usize,
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        max_ctx: usize,
    ) -> Result<Self> {
        if slots == 0 || layers == 0 || kv_heads == 0 || head_dim == 0 || max_ctx == 0 {
            return Err(KernelError::InvalidArgument(
                "KV cache with a zero dimension".into(),
            ));
        }
        let per = kv_heads
            .checked_mul(max_ctx)
            .and_then(|n| n.checked_mul(head_dim))
            .and_then(|n| n.checked_mul(slots))
            .ok_or_else(|| KernelError::InvalidArgument("KV cache size overflows".into()))?;
        let mut k = Vec::with_capacity(layers);
        let mut v = Vec::with_capacity(layers);
        for _ in 0..layers {
            k.push(DeviceBuffer::alloc(device, per)?);
            v.push(DeviceBuffer::alloc(device, per)?);
        }
        Ok(KvCache {
            slots,
            layers,
            kv_heads,
            head_dim,
            max_ctx,
            k,
            v,
        })
    }

    /// Bytes the cache occupies on the device.
    pub fn bytes(&self) -> usize {
        2 * self.layers * self.slots * self.slot_stride() * 2
    }

    /// Bytes of K and V one token takes over all layers.
    pub fn bytes_per_token(&self) -> usize {
        2 * self.layers * self.kv_heads * self.head_dim * 2
    }

    /// Halves from one slot's cache to the next within a layer.
    pub fn slot_stride(&self) -> usize {
        self.kv_heads * self.max_ctx * self.head_dim
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
        let n = self.slot_stride();
        Ok((k.sub(slot * n, n)?, v.sub(slot * n, n)?))
    }

    /// (keys, values) of `layer` for every slot (the batched step's view).
    pub fn layer_all(&self, layer: usize) -> Result<(DevSlice<u16>, DevSlice<u16>)> {
        match (self.k.get(layer), self.v.get(layer)) {
            (Some(k), Some(v)) => Ok((k.slice(), v.slice())),
            _ => Err(KernelError::InvalidArgument(format!(
                "layer {layer} of a {}-layer cache",
                self.layers
            ))),
        }
    }
}
