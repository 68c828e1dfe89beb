//! The KV cache of an executor: keys and values per layer, in one allocation per layer and
//! plane, laid out `[kv_head][row][head_dim]`.
//!
//! A layer that attends to the whole context is paged: its rows are a pool of blocks of
//! [`KV_BLOCK_TOKENS`] rows shared by every sequence, and each sequence slot has a block
//! table (a row of `max_blocks` block numbers on the device, kept by
//! [`KvCache::set_table`] from the host's `kiln_core::SequenceSlots`): position p of the
//! sequence is row p % 32 of block `table[p / 32]` (`kv_row` in common.cuh). A captured
//! graph keeps working as the sequence grows, since only the table's contents change.
//!
//! A sliding-window layer keeps a ring per slot instead (below), contiguous: slot s's ring
//! starts `s · slot_stride` values in, which is how a batched step reaches it. A cache built
//! by [`KvCache::with_format`] is all rings (a ring of the context is the identity), which
//! the kernel tests use.
//!
//! Two formats: f16 values, or q8_0 — one int8 per value plus one f16 scale per 32 values in
//! a plane of their own (the scale of value `e` at `e / 32`): ggml's q8_0 arithmetic (34
//! bytes per 32 values) without its 34-byte block stride, so that every kernel load stays
//! aligned and a slot, head or row offset (all multiples of 32 values) moves both planes.
//!
//! A layer keeps `rows` positions per KV head: the context, or for a sliding-window layer
//! only a ring of the window plus one prefill chunk (position p in row p % rows), which is
//! what Gemma 3's five local layers in six need.

use std::sync::Arc;

use kiln_core::{KvType, KV_BLOCK_TOKENS};

use crate::buffer::{DevSlice, DeviceBuffer};
use crate::device::{Args, Device};
use crate::error::{KernelError, Result};

/// How a KV cache stores its values: the [`KvType`]s a GPU cache can hold (f32, the CPU
/// reference's exact cache, is not one of them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvFormat {
    F16,
    Q8_0,
}

impl From<KvFormat> for KvType {
    fn from(f: KvFormat) -> KvType {
        match f {
            KvFormat::F16 => KvType::F16,
            KvFormat::Q8_0 => KvType::Q8_0,
        }
    }
}

impl KvFormat {
    /// The format of a cache of type `t`; `None` for a type no kernel stores (f32).
    pub fn of(t: KvType) -> Option<KvFormat> {
        match t {
            KvType::F16 => Some(KvFormat::F16),
            KvType::Q8_0 => Some(KvFormat::Q8_0),
            KvType::F32 => None,
        }
    }

    /// Bytes of one value in the value plane.
    pub fn value_bytes(self) -> usize {
        match self {
            KvFormat::F16 => 2,
            KvFormat::Q8_0 => 1,
        }
    }

    /// Bytes `values` values take in both planes (`values` a multiple of 32).
    pub fn bytes(self, values: usize) -> usize {
        match self {
            KvFormat::F16 => 2 * values,
            KvFormat::Q8_0 => values + values / 32 * 2,
        }
    }

    /// The suffix of the kernels that read or write this format (`attn_decode_q8_2`).
    pub(crate) fn kernel_suffix(self) -> &'static str {
        match self {
            KvFormat::F16 => "",
            KvFormat::Q8_0 => "_q8",
        }
    }
}

/// One layer's keys and values as the kernels take them (one slot's, or every slot's):
/// the value planes, and for q8_0 the scale planes. Cheap to copy; like [`DevSlice`], it
/// must not outlive the cache it came from.
#[derive(Debug, Clone, Copy)]
pub struct KvPlanes {
    pub format: KvFormat,
    k: DevSlice<u8>,
    v: DevSlice<u8>,
    k_scales: Option<DevSlice<u16>>,
    v_scales: Option<DevSlice<u16>>,
    /// A paged layer's block table(s): one sequence's (`max_blocks` entries), or every
    /// slot's in a row of `table_stride` each (the batched step's view). None: a ring.
    table: Option<DevSlice<i32>>,
    table_stride: usize,
}

impl KvPlanes {
    /// An f16 cache's planes.
    pub fn f16(k: DevSlice<u16>, v: DevSlice<u16>) -> Result<Self> {
        if k.len() != v.len() {
            return Err(invalid(format!(
                "K and V planes of {} and {} values",
                k.len(),
                v.len()
            )));
        }
        Ok(KvPlanes {
            format: KvFormat::F16,
            k: k.cast()?,
            v: v.cast()?,
            k_scales: None,
            v_scales: None,
            table: None,
            table_stride: 0,
        })
    }

    /// A q8_0 cache's planes: int8 values and one f16 scale per 32 of them.
    pub fn q8_0(
        k: DevSlice<i8>,
        v: DevSlice<i8>,
        k_scales: DevSlice<u16>,
        v_scales: DevSlice<u16>,
    ) -> Result<Self> {
        let n = k.len();
        if v.len() != n
            || !n.is_multiple_of(32)
            || k_scales.len() != n / 32
            || v_scales.len() != n / 32
        {
            return Err(invalid(format!(
                "q8_0 planes of {} / {} values and {} / {} scales",
                n,
                v.len(),
                k_scales.len(),
                v_scales.len()
            )));
        }
        Ok(KvPlanes {
            format: KvFormat::Q8_0,
            k: k.cast()?,
            v: v.cast()?,
            k_scales: Some(k_scales),
            v_scales: Some(v_scales),
            table: None,
            table_stride: 0,
        })
    }

    /// Values in each of K and V.
    pub fn values(&self) -> usize {
        self.k.len() / self.format.value_bytes()
    }

    /// Checks each plane holds at least `n` values; `what` names the cache in the error.
    pub fn check_len(&self, n: usize, what: &str) -> Result<()> {
        if self.values() < n {
            return Err(invalid(format!(
                "{what} holds {} values, {n} needed",
                self.values()
            )));
        }
        Ok(())
    }

    /// Values `start..start + len` of both planes (for q8_0 in whole 32-value blocks, so
    /// the scales follow).
    pub fn sub(&self, start: usize, len: usize) -> Result<KvPlanes> {
        if self.format == KvFormat::Q8_0 && (!start.is_multiple_of(32) || !len.is_multiple_of(32)) {
            return Err(invalid(format!(
                "KV range {start}+{len} is not in whole 32-value blocks"
            )));
        }
        let b = self.format.value_bytes();
        let scales = |s: Option<DevSlice<u16>>| s.map(|s| s.sub(start / 32, len / 32)).transpose();
        Ok(KvPlanes {
            format: self.format,
            k: self.k.sub(start * b, len * b)?,
            v: self.v.sub(start * b, len * b)?,
            k_scales: scales(self.k_scales)?,
            v_scales: scales(self.v_scales)?,
            table: None,
            table_stride: 0,
        })
    }

    /// The f16 value planes (K, V), or None for q8_0 (the tests' read-back).
    pub fn as_f16(&self) -> Option<(DevSlice<u16>, DevSlice<u16>)> {
        match self.format {
            KvFormat::F16 => Some((self.k.cast().ok()?, self.v.cast().ok()?)),
            KvFormat::Q8_0 => None,
        }
    }

    /// The q8_0 planes, or None for f16.
    pub fn as_q8_0(&self) -> Option<Q8Planes> {
        Some(Q8Planes {
            k: self.k.cast().ok()?,
            v: self.v.cast().ok()?,
            k_scales: self.k_scales?,
            v_scales: self.v_scales?,
        })
    }

    /// These planes read through a block table: `table` holds rows of `stride` entries (one
    /// row, `stride` = its length, for one sequence).
    pub fn with_table(mut self, table: DevSlice<i32>, stride: usize) -> Result<KvPlanes> {
        if stride == 0 || !table.len().is_multiple_of(stride) {
            return Err(invalid(format!(
                "a block table of {} entries in rows of {stride}",
                table.len()
            )));
        }
        self.table = Some(table);
        self.table_stride = stride;
        Ok(self)
    }

    /// The block table (None for a ring), and its row length.
    pub fn table(&self) -> Option<(DevSlice<i32>, usize)> {
        self.table.map(|t| (t, self.table_stride))
    }

    /// The block table's device address, 0 (a null pointer: a ring) without one.
    pub(crate) fn table_ptr(&self) -> u64 {
        self.table.map_or(0, |t| t.ptr())
    }

    /// Positions one sequence's view can address: its table's (paged), or `rows` (a ring).
    pub fn positions(&self, rows: usize) -> usize {
        match self.table {
            Some(_) => self.table_stride * KV_BLOCK_TOKENS,
            None => rows,
        }
    }

    /// Appends the four kernel parameters every KV kernel takes: K values, V values, K
    /// scales, V scales (null for f16).
    pub(crate) fn push(&self, args: Args) -> Args {
        args.ptr(self.k.ptr())
            .ptr(self.v.ptr())
            .ptr(self.k_scales.map_or(0, |s| s.ptr()))
            .ptr(self.v_scales.map_or(0, |s| s.ptr()))
    }
}

/// A q8_0 cache's four planes: int8 keys and values, and one f16 scale per 32 of each.
#[derive(Debug, Clone, Copy)]
pub struct Q8Planes {
    pub k: DevSlice<i8>,
    pub v: DevSlice<i8>,
    pub k_scales: DevSlice<u16>,
    pub v_scales: DevSlice<u16>,
}

/// One layer's storage.
struct LayerPlanes {
    k: DeviceBuffer<u8>,
    v: DeviceBuffer<u8>,
    scales: Option<(DeviceBuffer<u16>, DeviceBuffer<u16>)>,
}

/// How a layer keeps its rows: a ring of `rows` per slot (a sliding-window layer), or the
/// shared pool of blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvLayerRows {
    Ring(usize),
    Paged,
}

pub struct KvCache {
    pub slots: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub format: KvFormat,
    layout: Vec<KvLayerRows>,
    /// Blocks in the pool of the paged layers, and entries in a slot's block table.
    blocks: usize,
    max_blocks: usize,
    /// Every slot's block table, `max_blocks` entries each (zeros until set: block 0, a
    /// valid address, for entries past what a sequence holds, which no kernel reads).
    tables: Option<DeviceBuffer<i32>>,
    layers: Vec<LayerPlanes>,
}

impl KvCache {
    /// Allocates an f16 cache of rings: `slots` sequences, layer l keeping `rows[l]`
    /// positions a slot (contents undefined until written).
    pub fn new(
        device: &Arc<Device>,
        slots: usize,
        kv_heads: usize,
        head_dim: usize,
        rows: &[usize],
    ) -> Result<Self> {
        Self::with_format(device, KvFormat::F16, slots, kv_heads, head_dim, rows)
    }

    /// [`KvCache::new`] in `format`.
    pub fn with_format(
        device: &Arc<Device>,
        format: KvFormat,
        slots: usize,
        kv_heads: usize,
        head_dim: usize,
        rows: &[usize],
    ) -> Result<Self> {
        let layout: Vec<KvLayerRows> = rows.iter().map(|&r| KvLayerRows::Ring(r)).collect();
        Self::paged(device, format, slots, kv_heads, head_dim, &layout, 0, 0)
    }

    /// A cache whose `Paged` layers share a pool of `blocks` blocks of [`KV_BLOCK_TOKENS`]
    /// rows, each slot's block table holding `max_blocks` entries, and whose `Ring` layers
    /// keep their rings per slot.
    #[allow(clippy::too_many_arguments)]
    pub fn paged(
        device: &Arc<Device>,
        format: KvFormat,
        slots: usize,
        kv_heads: usize,
        head_dim: usize,
        layout: &[KvLayerRows],
        blocks: usize,
        max_blocks: usize,
    ) -> Result<Self> {
        let any_paged = layout.contains(&KvLayerRows::Paged);
        if slots == 0
            || layout.is_empty()
            || kv_heads == 0
            || head_dim == 0
            || layout.contains(&KvLayerRows::Ring(0))
            || (any_paged && (blocks == 0 || max_blocks == 0))
        {
            return Err(invalid("KV cache with a zero dimension".into()));
        }
        if !head_dim.is_multiple_of(32) && format == KvFormat::Q8_0 {
            return Err(KernelError::Unsupported(format!(
                "a q8_0 KV cache for heads of {head_dim} values (needs a multiple of 32)"
            )));
        }
        if blocks.saturating_mul(KV_BLOCK_TOKENS) > i32::MAX as usize {
            return Err(invalid(format!("a KV pool of {blocks} blocks")));
        }
        let mut layers = Vec::with_capacity(layout.len());
        for &l in layout {
            let rows = match l {
                KvLayerRows::Ring(r) => slots.checked_mul(r),
                KvLayerRows::Paged => Some(blocks * KV_BLOCK_TOKENS),
            };
            let per = rows
                .and_then(|n| n.checked_mul(kv_heads))
                .and_then(|n| n.checked_mul(head_dim))
                .and_then(|n| n.checked_mul(format.value_bytes()))
                .ok_or_else(|| invalid("KV cache size overflows".into()))?;
            let values = per / format.value_bytes();
            let scales = match format {
                KvFormat::F16 => None,
                KvFormat::Q8_0 => Some((
                    DeviceBuffer::alloc(device, values / 32)?,
                    DeviceBuffer::alloc(device, values / 32)?,
                )),
            };
            layers.push(LayerPlanes {
                k: DeviceBuffer::alloc(device, per)?,
                v: DeviceBuffer::alloc(device, per)?,
                scales,
            });
        }
        let tables = match any_paged {
            true => Some(DeviceBuffer::zeros(
                device,
                slots
                    .checked_mul(max_blocks)
                    .ok_or_else(|| invalid("KV block tables overflow".into()))?,
            )?),
            false => None,
        };
        Ok(KvCache {
            slots,
            kv_heads,
            head_dim,
            format,
            layout: layout.to_vec(),
            blocks,
            max_blocks,
            tables,
            layers,
        })
    }

    /// Layers the cache holds.
    pub fn layers(&self) -> usize {
        self.layout.len()
    }

    /// Bytes the cache occupies on the device.
    pub fn bytes(&self) -> usize {
        (0..self.layers())
            .map(|l| {
                2 * self
                    .format
                    .bytes(self.kv_heads * self.head_dim * self.plane_rows(l))
            })
            .sum()
    }

    /// Bytes of K and V one token of context takes over all layers (while a sliding-window
    /// layer's ring is filling; past it, only the full layers grow).
    pub fn bytes_per_token(&self) -> usize {
        2 * self.layers() * self.format.bytes(self.kv_heads * self.head_dim)
    }

    /// Bytes one block of the pool takes: K and V of every paged layer.
    pub fn block_bytes(&self) -> usize {
        let paged = self
            .layout
            .iter()
            .filter(|&&l| l == KvLayerRows::Paged)
            .count();
        2 * paged
            * self
                .format
                .bytes(KV_BLOCK_TOKENS * self.kv_heads * self.head_dim)
    }

    /// Whether `layer` is paged.
    pub fn is_paged(&self, layer: usize) -> bool {
        self.layout.get(layer) == Some(&KvLayerRows::Paged)
    }

    /// Rows a KV head of `layer` has in its planes: a ring's (per slot), or the whole
    /// pool's (paged) — what the kernels take as the head stride (0 for a layer out of range).
    pub fn rows(&self, layer: usize) -> usize {
        match self.layout.get(layer) {
            Some(KvLayerRows::Ring(r)) => *r,
            Some(KvLayerRows::Paged) => self.blocks * KV_BLOCK_TOKENS,
            None => 0,
        }
    }

    /// Rows of `layer`'s planes over all slots.
    fn plane_rows(&self, layer: usize) -> usize {
        match self.layout[layer] {
            KvLayerRows::Ring(r) => self.slots * r,
            KvLayerRows::Paged => self.blocks * KV_BLOCK_TOKENS,
        }
    }

    /// Values from one slot's ring to the next within `layer` (0 for a paged layer, whose
    /// slots differ by their block tables instead).
    pub fn slot_stride(&self, layer: usize) -> usize {
        match self.layout.get(layer) {
            Some(KvLayerRows::Ring(r)) => self.kv_heads * r * self.head_dim,
            _ => 0,
        }
    }

    /// Writes `slot`'s block table: the blocks its sequence holds, in order (the rest of
    /// its row is left as it was: no kernel reads past the sequence's length).
    pub fn set_table(&self, device: &Device, slot: usize, blocks: &[u32]) -> Result<()> {
        let Some(tables) = &self.tables else {
            return Ok(());
        };
        if slot >= self.slots
            || blocks.len() > self.max_blocks
            || blocks.iter().any(|&b| b as usize >= self.blocks)
        {
            return Err(invalid(format!(
                "a block table of {} entries for slot {slot} (slots {}, {} blocks, rows of {})",
                blocks.len(),
                self.slots,
                self.blocks,
                self.max_blocks
            )));
        }
        let row: Vec<i32> = blocks.iter().map(|&b| b as i32).collect();
        tables
            .slice()
            .sub(slot * self.max_blocks, row.len())?
            .copy_from_host(device, &row)
    }

    /// Keys and values of `layer` for the sequence in `slot`: its ring, or the pool and its
    /// block table.
    pub fn layer(&self, layer: usize, slot: usize) -> Result<KvPlanes> {
        let all = self.planes(layer)?;
        if slot >= self.slots {
            return Err(invalid(format!(
                "slot {slot} of a {}-slot cache",
                self.slots
            )));
        }
        match (&self.tables, self.layout[layer]) {
            (Some(t), KvLayerRows::Paged) => {
                let m = self.max_blocks;
                all.with_table(t.slice().sub(slot * m, m)?, m)
            }
            _ => {
                let n = self.slot_stride(layer);
                all.sub(slot * n, n)
            }
        }
    }

    /// Keys and values of `layer` for every slot (the batched step's view): every ring
    /// `slot_stride` values apart, or the pool with every slot's block table.
    pub fn layer_all(&self, layer: usize) -> Result<KvPlanes> {
        let all = self.planes(layer)?;
        match (&self.tables, self.layout[layer]) {
            (Some(t), KvLayerRows::Paged) => all.with_table(t.slice(), self.max_blocks),
            _ => Ok(all),
        }
    }

    fn planes(&self, layer: usize) -> Result<KvPlanes> {
        let l = self
            .layers
            .get(layer)
            .ok_or_else(|| invalid(format!("layer {layer} of a {}-layer cache", self.layers())))?;
        match &l.scales {
            None => KvPlanes::f16(l.k.slice().cast()?, l.v.slice().cast()?),
            Some((ks, vs)) => KvPlanes::q8_0(
                l.k.slice().cast()?,
                l.v.slice().cast()?,
                ks.slice(),
                vs.slice(),
            ),
        }
    }
}

fn invalid(message: String) -> KernelError {
    KernelError::InvalidArgument(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q8_planes(values: usize) -> KvPlanes {
        // Addresses only: nothing is dereferenced on the host.
        KvPlanes::q8_0(
            DevSlice::from_raw(0x10000, values),
            DevSlice::from_raw(0x20000, values),
            DevSlice::from_raw(0x30000, values / 32),
            DevSlice::from_raw(0x40000, values / 32),
        )
        .unwrap()
    }

    #[test]
    fn bytes_follow_the_format() {
        assert_eq!(KvFormat::F16.bytes(64), 128);
        // ggml's q8_0: 34 bytes a 32-value block.
        assert_eq!(KvFormat::Q8_0.bytes(64), 68);
    }

    #[test]
    fn q8_0_views_move_both_planes_in_whole_blocks() {
        let all = q8_planes(4 * 128);
        assert_eq!(all.values(), 512);
        let slot = all.sub(256, 128).unwrap();
        let q = slot.as_q8_0().unwrap();
        assert_eq!((q.k.ptr(), q.k.len()), (0x10000 + 256, 128));
        assert_eq!((q.v.ptr(), q.v.len()), (0x20000 + 256, 128));
        // One f16 scale per 32 values: 8 scales (16 bytes) in, 4 long.
        assert_eq!((q.k_scales.ptr(), q.k_scales.len()), (0x30000 + 16, 4));
        assert_eq!((q.v_scales.ptr(), q.v_scales.len()), (0x40000 + 16, 4));
        assert!(slot.as_f16().is_none());
        assert!(all.sub(16, 32).is_err(), "a view inside a block");
        assert!(all.sub(480, 64).is_err(), "a view past the end");
        assert!(all.check_len(512, "cache").is_ok());
        assert!(all.check_len(513, "cache").is_err());
    }

    #[test]
    fn q8_0_planes_must_agree() {
        let q = DevSlice::<i8>::from_raw(0x1000, 64);
        let d = DevSlice::<u16>::from_raw(0x2000, 2);
        assert!(KvPlanes::q8_0(q, q, d, d).is_ok());
        assert!(KvPlanes::q8_0(q, DevSlice::from_raw(0x1000, 32), d, d).is_err());
        assert!(KvPlanes::q8_0(q, q, DevSlice::from_raw(0x2000, 1), d).is_err());
        let odd = DevSlice::<i8>::from_raw(0x1000, 40);
        assert!(KvPlanes::q8_0(odd, odd, d, d).is_err());
    }

    #[test]
    fn f16_views_take_any_offset_and_pass_null_scales() {
        let k = DevSlice::<u16>::from_raw(0x1000, 96);
        let planes = KvPlanes::f16(k, DevSlice::from_raw(0x2000, 96)).unwrap();
        let sub = planes.sub(3, 5).unwrap();
        let (k, v) = sub.as_f16().unwrap();
        assert_eq!((k.ptr(), k.len(), v.ptr()), (0x1000 + 6, 5, 0x2000 + 6));
        assert!(KvPlanes::f16(k, DevSlice::from_raw(0x2000, 4)).is_err());
    }
}
