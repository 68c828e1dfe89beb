//! Weights in the GEMV kernels' device layout.
//!
//! ggml blocks of 18, 22, 34 or 210 bytes leave the quants unaligned, which forbids the
//! 16-byte loads that keep HBM busy. Each block is split, at upload, into a `body` (the
//! quant bytes, 16-byte aligned), an optional `qh` word and a `sc` entry — the same bytes,
//! so the same bandwidth, only reordered — as its [`WeightFormat`] describes; row-grouped
//! formats also interleave rows.

use std::sync::Arc;

use kiln_core::QType;
use rayon::prelude::*;

use crate::buffer::{DevSlice, DeviceBuffer};
use crate::device::Device;
use crate::error::{KernelError, Result};
use crate::format::WeightFormat;

/// A weight matrix in device layout, still on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct PackedWeight {
    pub format: &'static WeightFormat,
    pub qtype: QType,
    /// Values per row (the input length).
    pub row_len: usize,
    pub rows: usize,
    pub body: Vec<u8>,
    pub qh: Vec<u32>,
    pub sc: Vec<u8>,
}

impl PackedWeight {
    /// Splits `rows` rows of `row_len` ggml-encoded values into `qtype`'s plain layout.
    pub fn pack(qtype: QType, row_len: usize, rows: usize, ggml: &[u8]) -> Result<PackedWeight> {
        let format = WeightFormat::plain(qtype)
            .ok_or_else(|| KernelError::Unsupported(format!("GEMV with {qtype} weights")))?;
        Self::pack_as(format, row_len, rows, ggml)
    }

    /// Puts `rows` rows of `row_len` ggml-encoded values into `format`'s layout.
    pub fn pack_as(
        format: &'static WeightFormat,
        row_len: usize,
        rows: usize,
        ggml: &[u8],
    ) -> Result<PackedWeight> {
        let qtype = format.qtype;
        let expected = qtype
            .row_bytes(row_len)
            .ok()
            .and_then(|rb| rb.checked_mul(rows))
            .ok_or_else(|| {
                KernelError::InvalidArgument(format!("{rows} rows of {row_len} {qtype} values"))
            })?;
        if ggml.len() != expected {
            return Err(KernelError::InvalidArgument(format!(
                "{rows}x{row_len} {qtype} needs {expected} bytes, got {}",
                ggml.len()
            )));
        }
        let mut packed = PackedWeight {
            format,
            qtype,
            row_len,
            rows,
            body: Vec::new(),
            qh: Vec::new(),
            sc: Vec::new(),
        };
        if !qtype.is_quantized() {
            packed.body = ggml.to_vec();
            return Ok(packed);
        }
        if format.is_grouped() {
            packed.pack_grouped(ggml);
            return Ok(packed);
        }
        let bb = qtype.block_bytes();
        let nblocks = ggml.len() / bb;
        let (body, sc) = (format.body, format.sc);
        let sc_bytes = sc.map_or(0, |s| s.bytes);
        packed.body = vec![0u8; nblocks * body.bytes];
        packed.sc = vec![0u8; nblocks * sc_bytes];
        packed.qh = vec![0u32; if format.qh.is_some() { nblocks } else { 0 }];
        // Runs of blocks split the planes into disjoint parts, packed in parallel (a model's
        // upload repacks gigabytes; each block is independent of the others).
        const RUN: usize = 1 << 12;
        let mut runs = Vec::with_capacity(nblocks.div_ceil(RUN));
        let (mut src, mut b_out, mut s_out, mut q_out) = (
            ggml,
            packed.body.as_mut_slice(),
            packed.sc.as_mut_slice(),
            packed.qh.as_mut_slice(),
        );
        while !src.is_empty() {
            let n = (src.len() / bb).min(RUN);
            let (s_run, s_rest) = src.split_at(n * bb);
            let (b_run, b_rest) = std::mem::take(&mut b_out).split_at_mut(n * body.bytes);
            let (c_run, c_rest) = std::mem::take(&mut s_out).split_at_mut(n * sc_bytes);
            let q_len = if format.qh.is_some() { n } else { 0 };
            let (h_run, h_rest) = std::mem::take(&mut q_out).split_at_mut(q_len);
            runs.push((s_run, b_run, c_run, h_run));
            (src, b_out, s_out, q_out) = (s_rest, b_rest, c_rest, h_rest);
        }
        runs.into_par_iter()
            .for_each(|(src, body_out, sc_out, qh_out)| {
                // A format that rewrites the file's blocks does so one block at a time, on a
                // copy.
                let mut rewritten = vec![0u8; bb];
                for (i, blk) in src.chunks_exact(bb).enumerate() {
                    let blk = transcoded(format, blk, &mut rewritten);
                    body_out[i * body.bytes..(i + 1) * body.bytes]
                        .copy_from_slice(&blk[body.offset..body.offset + body.bytes]);
                    if let Some(q) = format.qh {
                        qh_out[i] = u32::from_le_bytes(blk[q..q + 4].try_into().expect("4 bytes"));
                    }
                    if let Some(s) = sc {
                        sc_out[i * s.bytes..(i + 1) * s.bytes]
                            .copy_from_slice(&blk[s.offset..s.offset + s.bytes]);
                    }
                }
            });
        Ok(packed)
    }

    /// The row-grouped layout (see `format`'s module doc): groups of `G` rows; in a group,
    /// tiles of up to 32 chunks, each row's quant blocks of a tile contiguous; the G scales
    /// of one chunk side by side. Missing rows of the last group are zero blocks.
    fn pack_grouped(&mut self, ggml: &[u8]) {
        let f = self.format;
        let g = f.row_group;
        let bb = self.qtype.block_bytes();
        let (body, sc) = (f.body, f.sc.expect("grouped formats have a scale"));
        let nchunks = self.row_len / self.qtype.block_len();
        let groups = self.rows.div_ceil(g);
        let mut rewritten = vec![0u8; bb];
        self.body = vec![0u8; groups * g * nchunks * body.bytes];
        self.sc = vec![0u8; groups * g * nchunks * sc.bytes];
        for row in 0..self.rows {
            let (grp, r) = (row / g, row % g);
            for c in 0..nchunks {
                let blk = transcoded(f, &ggml[(row * nchunks + c) * bb..][..bb], &mut rewritten);
                let (tile, j) = (c / 32, c % 32);
                let width = (nchunks - tile * 32).min(32);
                let at = ((grp * nchunks + tile * 32) * g + r * width + j) * body.bytes;
                self.body[at..at + body.bytes]
                    .copy_from_slice(&blk[body.offset..body.offset + body.bytes]);
                let at = ((grp * nchunks + c) * g + r) * sc.bytes;
                self.sc[at..at + sc.bytes].copy_from_slice(&blk[sc.offset..sc.offset + sc.bytes]);
            }
        }
    }

    /// Bytes a GEMV reads from this weight.
    pub fn bytes(&self) -> usize {
        self.body.len() + 4 * self.qh.len() + self.sc.len()
    }
}

/// `block` as `format`'s kernels read it: the file's bytes, or their rewrite into `scratch`.
fn transcoded<'a>(format: &WeightFormat, block: &'a [u8], scratch: &'a mut [u8]) -> &'a [u8] {
    match format.transcode {
        Some(transcode) => {
            scratch.copy_from_slice(block);
            transcode(scratch);
            scratch
        }
        None => block,
    }
}

/// A weight matrix resident on the device.
pub struct DeviceWeight {
    pub format: &'static WeightFormat,
    pub qtype: QType,
    pub row_len: usize,
    pub rows: usize,
    body: DeviceBuffer<u8>,
    qh: DeviceBuffer<u32>,
    sc: DeviceBuffer<u8>,
}

/// The scale plane padded with zeros to whole 4-byte words: the pipelined batched matmul
/// copies Q6_K's 2-byte scales as the aligned words around them (`cuda/bmm.cu`).
fn padded_to_words(sc: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    if sc.len().is_multiple_of(4) {
        std::borrow::Cow::Borrowed(sc)
    } else {
        let mut v = sc.to_vec();
        v.resize(sc.len().next_multiple_of(4), 0);
        std::borrow::Cow::Owned(v)
    }
}

impl DeviceWeight {
    pub fn upload(device: &Arc<Device>, w: &PackedWeight) -> Result<DeviceWeight> {
        Ok(DeviceWeight {
            format: w.format,
            qtype: w.qtype,
            row_len: w.row_len,
            rows: w.rows,
            body: DeviceBuffer::from_host(device, &w.body)?,
            qh: DeviceBuffer::from_host(device, &w.qh)?,
            sc: DeviceBuffer::from_host(device, &padded_to_words(&w.sc))?,
        })
    }

    /// Packs and uploads ggml bytes in one go.
    pub fn from_ggml(
        device: &Arc<Device>,
        qtype: QType,
        row_len: usize,
        rows: usize,
        ggml: &[u8],
    ) -> Result<DeviceWeight> {
        Self::upload(device, &PackedWeight::pack(qtype, row_len, rows, ggml)?)
    }

    /// Packs ggml bytes into `format` and uploads them.
    pub fn from_ggml_as(
        device: &Arc<Device>,
        format: &'static WeightFormat,
        row_len: usize,
        rows: usize,
        ggml: &[u8],
    ) -> Result<DeviceWeight> {
        Self::upload(device, &PackedWeight::pack_as(format, row_len, rows, ggml)?)
    }

    /// (body, qh, sc) device addresses; absent parts are 0.
    pub fn ptrs(&self) -> (u64, u64, u64) {
        (self.body.ptr(), self.qh.ptr(), self.sc.ptr())
    }

    pub fn bytes(&self) -> usize {
        self.body.bytes() + self.qh.bytes() + self.sc.bytes()
    }

    pub fn body(&self) -> DevSlice<u8> {
        self.body.slice()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::Q4_0_X4;

    /// A weight of many runs of blocks (packed in parallel, a run each) is byte for byte
    /// its rows packed one at a time, in formats with a fifth-bit word, a transcode, and
    /// scales of their own; the last run part-full.
    #[test]
    fn a_weight_of_many_runs_packs_as_its_rows_alone() {
        let mut rng = kiln_core::Rng::new(5);
        for tag in ["q5_0", "q4_k", "q6_k", "iq3_s", "mxfp4"] {
            let f = crate::format::WeightFormat::by_tag(tag).expect("format");
            let q = f.qtype;
            // 10,300 blocks: two full runs of 4,096 and part of a third.
            let (row_len, rows) = (q.block_len() * 515, 20);
            let ggml = crate::testdata::random_weights(&mut rng, q, row_len, rows).unwrap();
            let all = PackedWeight::pack_as(f, row_len, rows, &ggml).unwrap();
            let rb = q.row_bytes(row_len).unwrap();
            let (mut body, mut qh, mut sc) = (Vec::new(), Vec::new(), Vec::new());
            for r in 0..rows {
                let one =
                    PackedWeight::pack_as(f, row_len, 1, &ggml[r * rb..(r + 1) * rb]).unwrap();
                body.extend(one.body);
                qh.extend(one.qh);
                sc.extend(one.sc);
            }
            assert!(all.body == body && all.qh == qh && all.sc == sc, "{tag}");
        }
    }

    /// A Mixture of Experts' projection goes up as one weight of every expert's rows
    /// (`experts.rs`), and the expert GEMVs read expert `e` as rows `e·rows..` of it: in
    /// every device format, expert `e`'s share of the stacked planes is byte for byte the
    /// planes of its matrix packed alone, at `e` times their size.
    #[test]
    fn a_stack_of_experts_packs_as_each_expert_alone() {
        let mut rng = kiln_core::Rng::new(11);
        let (count, rows) = (3usize, 8usize);
        for &format in crate::format::FORMATS.iter() {
            // 40 chunks of 32: Q4_0_X4 tiles them 32 and 8.
            let k = 1280;
            let expert_bytes = format.qtype.row_bytes(k).unwrap() * rows;
            let stacked: Vec<u8> = (0..count * expert_bytes)
                .map(|_| rng.next_u64() as u8)
                .collect();
            let all = PackedWeight::pack_as(format, k, count * rows, &stacked).unwrap();
            for e in 0..count {
                let alone = PackedWeight::pack_as(
                    format,
                    k,
                    rows,
                    &stacked[e * expert_bytes..(e + 1) * expert_bytes],
                )
                .unwrap();
                let share = |plane: &[u8], len: usize| plane[e * len..(e + 1) * len].to_vec();
                assert_eq!(
                    share(&all.body, alone.body.len()),
                    alone.body,
                    "{} expert {e}: body",
                    format.tag
                );
                assert_eq!(
                    share(&all.sc, alone.sc.len()),
                    alone.sc,
                    "{} expert {e}: scales",
                    format.tag
                );
                let qh = alone.qh.len();
                assert_eq!(
                    all.qh[e * qh..(e + 1) * qh],
                    alone.qh[..],
                    "{} expert {e}: fifth bits",
                    format.tag
                );
            }
        }
    }

    /// The row-grouped layout is a permutation of the blocks (plus zero padding rows):
    /// every block's quants and scale land exactly once, where the kernels' offset formula
    /// (`block_offsets` in gemv.cu, restated here) looks for them.
    #[test]
    fn q4_0_x4_places_every_block_where_the_kernels_read_it() {
        for (k, rows) in [(576usize, 7usize), (2048, 12), (1088, 5)] {
            let nchunks = k / 32;
            // Block (row, c): scale bytes = (row, c) tag, quants = a pattern of both.
            let mut ggml = Vec::new();
            for row in 0..rows {
                for c in 0..nchunks {
                    ggml.extend_from_slice(&[(row as u8).wrapping_mul(3), c as u8]);
                    ggml.extend((0..16u8).map(|i| i ^ row as u8 ^ (c as u8).rotate_left(3)));
                }
            }
            let p = PackedWeight::pack_as(&Q4_0_X4, k, rows, &ggml).unwrap();
            let groups = rows.div_ceil(4);
            assert_eq!(p.body.len(), groups * 4 * nchunks * 16);
            assert_eq!(p.sc.len(), groups * 4 * nchunks * 2);
            for row in 0..groups * 4 {
                for c in 0..nchunks {
                    let (g, r) = (row / 4, row % 4);
                    let tile = c & !31;
                    let width = (nchunks - tile).min(32);
                    let body = ((g * nchunks + tile) * 4 + r * width + (c & 31)) * 16;
                    let sc = ((g * nchunks + c) * 4 + r) * 2;
                    if row < rows {
                        let blk = &ggml[(row * nchunks + c) * 18..][..18];
                        assert_eq!(&p.body[body..body + 16], &blk[2..], "row {row} chunk {c}");
                        assert_eq!(&p.sc[sc..sc + 2], &blk[..2], "row {row} chunk {c}");
                    } else {
                        assert!(p.body[body..body + 16].iter().all(|&b| b == 0));
                        assert!(p.sc[sc..sc + 2].iter().all(|&b| b == 0));
                    }
                }
            }
        }
    }
}
