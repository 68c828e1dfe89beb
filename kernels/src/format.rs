//! One description per weight format on the GPU: where each part of a ggml block goes in
//! device memory, how rows are grouped, the CUDA type id the kernels specialise on, and the
//! GEMV and dequantisation modules that read it. Kernel names, type tags, the list of
//! GEMV-capable types and the modules to compile are all derived from [`FORMATS`]; adding a
//! format is one entry here plus its `T_*` case in `cuda/gemv.cu` (and `dequant.cu`).
//!
//! Two kinds of layout:
//! - *plain* (one per ggml type): each block split into a 16-byte-aligned `body` (the
//!   quants), an optional `qh` word (Q5_0/Q5_1's fifth bits) and a `sc` entry (the f16
//!   scale, or scale and min), rows one after another. Same bytes as the file, reordered so
//!   every load is aligned and vectorised.
//! - *row-grouped* (`Q4_0_X4`): rows stored in groups of four. Within a group, for each tile
//!   of up to 32 consecutive 32-value chunks, row 0's 16-byte quant blocks of the tile come
//!   first, then row 1's, …; the four rows' f16 scales of one chunk sit side by side (8
//!   bytes). A warp whose lanes take the 32 chunks of a tile reads 512 contiguous bytes per
//!   row and the four scales of its chunk in one 8-byte load. The row count is padded to a
//!   multiple of four with zero blocks (scale 0: they contribute nothing).
//!
//! A second 4-bit block format maps onto the same device layout with one more entry: APR's
//! 4-bit type (f16 scale + 16 nibble bytes per 32 values, symmetric, nibbles in element
//! order) has `apr_q4` / `apr_q4x4`, whose `transcode` permutes each block's nibbles into
//! Q4_0's order at upload (lossless), and Q4_0's kernels.

use kiln_core::QType;

use crate::compile::{KernelModule, GEMV_SRC};
use crate::GemvPath;

/// Where one part of a ggml block lies (`offset` into the block, `bytes` long).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    pub offset: usize,
    pub bytes: usize,
}

/// A format's GEMV modules. Kept small so a model compiles only what its activation path
/// calls, in parallel: for each path the plain GEMVs (`gemv_`/`swiglu_`, every tiling and
/// split) and, on the integer paths, those that quantise their output (`gemvq_`/`swigluq_`).
#[derive(Debug, Clone, Copy)]
pub struct GemvModules {
    pub float: KernelModule,
    pub q8: [KernelModule; 2],
    pub q16: [KernelModule; 2],
}

impl GemvModules {
    /// The modules a decode on `path` launches from.
    pub fn for_path(&self, path: GemvPath) -> &[KernelModule] {
        match path {
            GemvPath::Float => std::slice::from_ref(&self.float),
            GemvPath::Q8 => &self.q8,
            GemvPath::Q16 => &self.q16,
        }
    }

    /// The module holding `path`'s plain (`quantising == false`) or quantising GEMVs; the
    /// float path has no quantising ones.
    pub fn module(&self, path: GemvPath, quantising: bool) -> Option<&KernelModule> {
        self.for_path(path).get(quantising as usize)
    }

    /// Every module (compile checks).
    pub fn all(&self) -> impl Iterator<Item = KernelModule> + '_ {
        std::iter::once(self.float).chain(self.q8).chain(self.q16)
    }
}

/// A weight matrix format on the device.
#[derive(Debug)]
pub struct WeightFormat {
    /// The ggml type whose blocks it holds.
    pub qtype: QType,
    /// Kernel-name tag: `gemv_{tag}_…`, `embed_{tag}`, `dequant_{tag}`.
    pub tag: &'static str,
    /// The `T_*` constant the CUDA templates specialise on.
    pub cuda_type: &'static str,
    /// Rows stored together: 1 (plain), or 4 (`Q4_0_X4`). A GEMV's rows per warp must be a
    /// multiple of it.
    pub row_group: usize,
    /// The quant bytes of a block (for float types: one element).
    pub body: Part,
    /// The offset of a u32 of fifth bits in the block, if the type has one.
    pub qh: Option<usize>,
    /// The scale (or scale and min) of a block, if it has one outside `body`.
    pub sc: Option<Part>,
    /// The embedding lookup (`embed_{tag}`).
    pub embed: KernelModule,
    /// The GEMV kernels, one small module per activation path and kind (see
    /// [`GemvModules`]).
    pub gemv: GemvModules,
    /// The whole-matrix dequantisation kernel (batched prefill) for this format.
    pub dequant: KernelModule,
    /// The batched decode matmuls on int8 tensor cores (`cuda/bmm.cu`), for every
    /// integer format; float weights have none (a batch multiplies them row by row).
    pub batched: Option<KernelModule>,
    /// Rewrites the file's blocks into the blocks the kernels read, before the parts are
    /// split out (APR's 4-bit blocks become Q4_0 blocks: a lossless nibble permutation).
    pub transcode: Option<fn(&mut [u8])>,
}

/// One GEMV module: `gemv.cu` and one `GEMV_{kind}{rows}(tag_path, T, A)` line.
macro_rules! gemv_module {
    ($prefix:literal, $kind:literal, $r4:literal, $tag:literal, $path:literal, $cuda:literal, $a:literal) => {
        KernelModule::with_suffix(
            concat!($prefix, $tag, "_", $path),
            GEMV_SRC,
            concat!("GEMV_", $kind, $r4, "(", $tag, "_", $path, ", ", $cuda, ", ", $a, ")"),
        )
    };
}

macro_rules! weight_format {
    ($q:ident, $tag:literal, $cuda:literal, group $group:literal,
     body $bo:literal + $bb:literal, qh $qh:expr, sc $sc:expr) => {
        weight_format!($q, $tag, $cuda, group $group, body $bo + $bb, qh $qh, sc $sc,
            rows "", transcode None)
    };
    // Float weights: no batched (integer) matmul.
    (float $q:ident, $tag:literal, $cuda:literal, body $bb:literal) => {
        WeightFormat {
            batched: None,
            ..weight_format!($q, $tag, $cuda, group 1, body 0 + $bb, qh None, sc None)
        }
    };
    ($q:ident, $tag:literal, $cuda:literal, group $group:literal,
     body $bo:literal + $bb:literal, qh $qh:expr, sc $sc:expr, rows $r4:literal,
     transcode $tc:expr) => {
        WeightFormat {
            qtype: QType::$q,
            tag: $tag,
            cuda_type: $cuda,
            row_group: $group,
            body: Part { offset: $bo, bytes: $bb },
            qh: $qh,
            sc: $sc,
            embed: KernelModule::with_suffix(
                concat!("embed_", $tag),
                GEMV_SRC,
                concat!("EMBED_ENTRY(", $tag, ", ", $cuda, ")"),
            ),
            gemv: GemvModules {
                float: gemv_module!("gemv_", "PLAIN", $r4, $tag, "f", $cuda, "A_F32"),
                q8: [
                    gemv_module!("gemv_", "PLAIN", $r4, $tag, "q", $cuda, "A_Q8"),
                    gemv_module!("gemvq_", "QUANTISING", $r4, $tag, "q", $cuda, "A_Q8"),
                ],
                q16: [
                    gemv_module!("gemv_", "PLAIN", $r4, $tag, "w", $cuda, "A_Q16"),
                    gemv_module!("gemvq_", "QUANTISING", $r4, $tag, "w", $cuda, "A_Q16"),
                ],
            },
            dequant: KernelModule::with_suffix(
                concat!("dequant_", $tag),
                GEMV_SRC,
                concat!(
                    include_str!("../cuda/dequant.cu"),
                    "\nDEQUANT_TYPE(",
                    $tag,
                    ", ",
                    $cuda,
                    ")"
                ),
            ),
            batched: Some(KernelModule::with_suffix(
                concat!("bmm_", $tag),
                GEMV_SRC,
                concat!(include_str!("../cuda/bmm.cu"), "\nBMM_TYPE(", $tag, ", ", $cuda, ")"),
            )),
            transcode: $tc,
        }
    };
}

/// APR 4-bit blocks to Q4_0 blocks, in place (same scale, nibbles in Q4_0's order).
fn apr_q4_to_q4_0(bytes: &mut [u8]) {
    for block in bytes.chunks_exact_mut(18) {
        let src: [u8; 18] = (&*block).try_into().expect("18-byte blocks");
        block.copy_from_slice(&kiln_core::quant::apr_q4_block_to_q4_0(&src));
    }
}

const fn sc(offset: usize, bytes: usize) -> Option<Part> {
    Some(Part { offset, bytes })
}

/// Every format the GPU kernels read. The first entry for a type is its plain layout.
pub static FORMATS: [WeightFormat; 14] = [
    weight_format!(float F32, "f32", "T_F32", body 4),
    weight_format!(float F16, "f16", "T_F16", body 2),
    weight_format!(float BF16, "bf16", "T_BF16", body 2),
    weight_format!(Q4_0, "q4_0", "T_Q4_0", group 1, body 2 + 16, qh None, sc sc(0, 2)),
    weight_format!(Q4_1, "q4_1", "T_Q4_1", group 1, body 4 + 16, qh None, sc sc(0, 4)),
    weight_format!(Q5_0, "q5_0", "T_Q5_0", group 1, body 6 + 16, qh Some(2), sc sc(0, 2)),
    weight_format!(Q5_1, "q5_1", "T_Q5_1", group 1, body 8 + 16, qh Some(4), sc sc(0, 4)),
    weight_format!(Q8_0, "q8_0", "T_Q8_0", group 1, body 2 + 32, qh None, sc sc(0, 2)),
    weight_format!(Q4_K, "q4_k", "T_Q4_K", group 1, body 0 + 144, qh None, sc None),
    weight_format!(Q5_K, "q5_k", "T_Q5_K", group 1, body 0 + 176, qh None, sc None),
    weight_format!(Q6_K, "q6_k", "T_Q6_K", group 1, body 0 + 208, qh None, sc sc(208, 2)),
    // Q4_0 in rows of four (the `cuda-q4_0` backend's GEMV layout).
    weight_format!(Q4_0, "q4_0x4", "T_Q4_0X4", group 4, body 2 + 16, qh None, sc sc(0, 2),
        rows "_R4", transcode None),
    // APR's 4-bit type: transcoded to Q4_0 blocks at upload, then Q4_0's kernels.
    weight_format!(AprQ4, "apr_q4", "T_Q4_0", group 1, body 2 + 16, qh None, sc sc(0, 2),
        rows "", transcode Some(apr_q4_to_q4_0)),
    weight_format!(AprQ4, "apr_q4x4", "T_Q4_0X4", group 4, body 2 + 16, qh None, sc sc(0, 2),
        rows "_R4", transcode Some(apr_q4_to_q4_0)),
];

/// Q4_0 weights stored in groups of four rows (see the module doc).
pub static Q4_0_X4: &WeightFormat = &FORMATS[11];
/// APR 4-bit weights, transcoded to Q4_0 and stored in groups of four rows.
pub static APR_Q4_X4: &WeightFormat = &FORMATS[13];

/// Formats are told apart by their tag (unique in `FORMATS`).
impl PartialEq for WeightFormat {
    fn eq(&self, other: &Self) -> bool {
        self.tag == other.tag
    }
}
impl Eq for WeightFormat {}

impl WeightFormat {
    /// The plain device layout of `qtype`, if the GEMV kernels multiply with it.
    pub fn plain(qtype: QType) -> Option<&'static WeightFormat> {
        FORMATS
            .iter()
            .find(|f| f.qtype == qtype && f.row_group == 1)
    }

    /// The format named `tag`.
    pub fn by_tag(tag: &str) -> Option<&'static WeightFormat> {
        FORMATS.iter().find(|f| f.tag == tag)
    }

    /// Whether rows are grouped (interleaved) rather than stored one after another.
    pub fn is_grouped(&self) -> bool {
        self.row_group > 1
    }
}

/// Weight types the GEMV kernels multiply with (each has a plain format).
pub fn gemv_qtypes() -> Vec<QType> {
    let mut v: Vec<QType> = FORMATS
        .iter()
        .filter(|f| !f.is_grouped())
        .map(|f| f.qtype)
        .collect();
    v.dedup();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_part_lies_inside_its_block() {
        for f in &FORMATS {
            let block = f.qtype.block_bytes();
            let elem = if f.qtype.is_quantized() {
                block
            } else {
                f.body.bytes
            };
            assert!(f.body.offset + f.body.bytes <= elem, "{}", f.tag);
            if let Some(q) = f.qh {
                assert!(q + 4 <= block, "{}", f.tag);
            }
            if let Some(s) = f.sc {
                assert!(s.offset + s.bytes <= block, "{}", f.tag);
            }
            // The body is what the 16-byte loads read.
            assert!(
                !f.qtype.is_quantized() || f.body.bytes % 16 == 0,
                "{}",
                f.tag
            );
        }
    }

    #[test]
    fn tags_are_unique_and_each_gemv_type_has_one_plain_format() {
        let mut tags: Vec<&str> = FORMATS.iter().map(|f| f.tag).collect();
        tags.sort();
        tags.dedup();
        assert_eq!(tags.len(), FORMATS.len());
        for q in gemv_qtypes() {
            assert_eq!(WeightFormat::plain(q).unwrap().qtype, q);
        }
        assert_eq!(gemv_qtypes().len(), 12);
        assert_eq!(Q4_0_X4.tag, "q4_0x4");
        assert_eq!(APR_Q4_X4.tag, "apr_q4x4");
    }
}
