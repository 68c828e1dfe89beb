//! The KV cache: f16 keys and values per layer, laid out `[kv_head][position][head_dim]`
//! so one head's history is contiguous for the attention kernel.

use std::sync::Arc;

use crate::buffer::{DevSlice, DeviceBuffer};
use crate::device::Device;
use crate::error::{KernelError, Result};

pub struct KvCache {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub max_ctx: usize,
    k: Vec<DeviceBuffer<u16>>,
    v: Vec<DeviceBuffer<u16>>,
}

impl KvCache {
    /// Allocates the cache for one sequence (contents undefined until written).
    pub fn new(
        device: &Arc<Device>,
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        max_ctx: usize,
    ) -> Result<Self> {
        if layers == 0 || kv_heads == 0 || head_dim == 0 || max_ctx == 0 {
            return Err(KernelError::InvalidArgument(
                "KV cache with a zero dimension".into(),
            ));
        }
        let per = kv_heads * max_ctx * head_dim;
        let mut k = Vec::with_capacity(layers);
        let mut v = Vec::with_capacity(layers);
        for _ in 0..layers {
            k.push(DeviceBuffer::alloc(device, per)?);
            v.push(DeviceBuffer::alloc(device, per)?);
        }
        Ok(KvCache {
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
        2 * self.layers * self.kv_heads * self.max_ctx * self.head_dim * 2
    }

    /// (keys, values) of `layer`.
    pub fn layer(&self, layer: usize) -> Result<(DevSlice<u16>, DevSlice<u16>)> {
        match (self.k.get(layer), self.v.get(layer)) {
            (Some(k), Some(v)) => Ok((k.slice(), v.slice())),
            _ => Err(KernelError::InvalidArgument(format!(
                "layer {layer} of a {}-layer cache",
                self.layers
            ))),
        }
    }
}
