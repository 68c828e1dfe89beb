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
//! Q4_K and Q5_K keep their whole blocks in `body`, but their twelve bytes of 6-bit sub-block
//! scales and mins are rewritten at upload ([`kquant_scales_for_device`], lossless) so a
//! lane finds the pair of sub-blocks it works on with the same shifts whichever pair it
//! is: ggml's packing stores sub-blocks 0–3 and 4–7 differently, so the lanes of one warp,
//! which take different pairs, ran both branches of its decoder.
//!
//! Q6_K keeps its block too, its quant bits regrouped per 32-value chunk at upload
//! ([`q6k_block_for_device`], lossless): a chunk's low nibbles in 16 bytes (value `j` and
//! `j + 16` share byte `j`, as in Q4_0) and its high 2-bit parts in 8, so a lane reads its
//! chunk in one 16-byte and one 8-byte load instead of 32 bytes of each array, 24 of them
//! another lane's.
//!
//! A second 4-bit block format maps onto the same device layout with one more entry: APR's
//! 4-bit type (f16 scale + 16 nibble bytes per 32 values, symmetric, nibbles in element
//! order) has `apr_q4` / `apr_q4x4`, whose `transcode` permutes each block's nibbles into
//! Q4_0's order at upload (lossless), and Q4_0's kernels.

use kiln_core::QType;

use crate::compile::{KernelModule, GEMV_GRID_SRC, GEMV_SRC};
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
    ($src:expr, $prefix:literal, $kind:literal, $r4:literal, $tag:literal, $path:literal, $cuda:literal, $a:literal) => {
        KernelModule::with_suffix(
            concat!($prefix, $tag, "_", $path),
            $src,
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
    ($q:ident, $tag:literal, $cuda:literal, group $group:literal,
     body $bo:literal + $bb:literal, qh $qh:expr, sc $sc:expr, rows $r4:literal,
     transcode $tc:expr) => {
        weight_format!($q, $tag, $cuda, group $group, body $bo + $bb, qh $qh, sc $sc,
            rows $r4, transcode $tc, source GEMV_SRC)
    };
    // The grid I-quants: their modules define the lattices.
    (grid $q:ident, $tag:literal, $cuda:literal, body $bo:literal + $bb:literal, sc $sc:expr,
     transcode $tc:expr) => {
        weight_format!($q, $tag, $cuda, group 1, body $bo + $bb, qh None, sc $sc,
            rows "", transcode $tc, source GEMV_GRID_SRC)
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
     transcode $tc:expr, source $src:expr) => {
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
                $src,
                concat!("EMBED_ENTRY(", $tag, ", ", $cuda, ")"),
            ),
            gemv: GemvModules {
                float: gemv_module!($src, "gemv_", "PLAIN", $r4, $tag, "f", $cuda, "A_F32"),
                q8: [
                    gemv_module!($src, "gemv_", "PLAIN", $r4, $tag, "q", $cuda, "A_Q8"),
                    gemv_module!($src, "gemvq_", "QUANTISING", $r4, $tag, "q", $cuda, "A_Q8"),
                ],
                q16: [
                    gemv_module!($src, "gemv_", "PLAIN", $r4, $tag, "w", $cuda, "A_Q16"),
                    gemv_module!($src, "gemvq_", "QUANTISING", $r4, $tag, "w", $cuda, "A_Q16"),
                ],
            },
            dequant: KernelModule::with_suffix(
                concat!("dequant_", $tag),
                $src,
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
                $src,
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

/// The twelve scale bytes of a Q4_K/Q5_K block (ggml's packing of eight 6-bit scales and
/// eight 6-bit mins, see [`kiln_core::quant::kquants::scale_min_k4`]) in the layout the kernels
/// decode (`k4_scale_min_w` / `k4_scale_min_pair` in gemv.cu):
/// - byte `j` (0..8): sub-block `j`'s scale, low 4 bits, and its min's low 4 bits above them;
/// - byte `8 + p` (0..4): the high 2 bits of sub-blocks `2p` and `2p + 1`, in the order
///   scale `2p`, min `2p`, scale `2p + 1`, min `2p + 1` from bit 0.
///
/// A lane working on sub-blocks `2p` and `2p + 1` reads 16 bits at `2p` and byte `8 + p`:
/// the same shifts for every `p`, so the lanes of a warp never diverge.
pub fn kquant_scales_for_device(ggml: &[u8; 12]) -> [u8; 12] {
    let mut out = [0u8; 12];
    for j in 0..8 {
        let (sc, m) = kiln_core::quant::kquants::scale_min_k4(ggml, j);
        out[j] = (sc & 15) | ((m & 15) << 4);
        out[8 + j / 2] |= ((sc >> 4) | ((m >> 4) << 2)) << (4 * (j & 1));
    }
    out
}

/// Q4_K / Q5_K blocks of `BLOCK` bytes with their scales in the device layout, in place.
fn kquant_blocks_for_device<const BLOCK: usize>(bytes: &mut [u8]) {
    for block in bytes.chunks_exact_mut(BLOCK) {
        let scales: &mut [u8; 12] = (&mut block[4..16]).try_into().expect("12 scale bytes");
        *scales = kquant_scales_for_device(scales);
    }
}

/// The 6-bit codes (0..64, value = d·scale·(code − 32)) of a Q6_K block in ggml's layout:
/// per 128-value half, 64 bytes of low nibbles (values l and l + 64 share byte l, values
/// l + 32 and l + 96 byte l + 32) and 32 bytes of 2-bit high parts (byte l: values l,
/// l + 32, l + 64, l + 96 from bit 0).
fn q6k_codes(block: &[u8]) -> [u8; 256] {
    let mut codes = [0u8; 256];
    for half in 0..2 {
        let ql = &block[64 * half..64 * half + 64];
        let qh = &block[128 + 32 * half..128 + 32 * half + 32];
        for l in 0..32 {
            let c = &mut codes[128 * half..];
            c[l] = (ql[l] & 15) | ((qh[l] & 3) << 4);
            c[l + 32] = (ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4);
            c[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            c[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
    codes
}

/// A Q6_K block (210 bytes) in the layout the kernels read (`dot_chunk`, `dequant_chunk`,
/// `bmm_frag`): the same 210 bytes with the quant bits regrouped per 32-value chunk `c`.
/// - bytes `16c..16c + 16`: byte `j` holds code `j`'s low nibble and code `j + 16`'s above it;
/// - bytes `128 + 8c..128 + 8c + 8`, read as two u32 words: the high 2 bits of code
///   `4i + b` (i = 0..8, b = 0..4) at bit `2·(i mod 4)` of byte `b` of word `i / 4`, so
///   `(word >> 2·(i mod 4)) & 0x03030303` puts codes `4i..4i + 4`'s bits in four bytes;
/// - the scales (bytes 192..208, two per chunk, in chunk order already) and `d` stay.
pub fn q6k_block_for_device(block: &mut [u8]) {
    let codes = q6k_codes(block);
    block[..192].fill(0);
    for c in 0..8 {
        let chunk = &codes[32 * c..32 * c + 32];
        for j in 0..16 {
            block[16 * c + j] = (chunk[j] & 15) | ((chunk[j + 16] & 15) << 4);
        }
        for (v, &code) in chunk.iter().enumerate() {
            let (i, b) = (v / 4, v % 4);
            block[128 + 8 * c + 4 * (i / 4) + b] |= (code >> 4) << (2 * (i % 4));
        }
    }
}

/// Q6_K blocks in the device layout, in place.
fn q6k_blocks_for_device(bytes: &mut [u8]) {
    for block in bytes.chunks_exact_mut(210) {
        q6k_block_for_device(block);
    }
}

/// A 32-value chunk's 2-bit codes as the kernels read them (`k23_word` in gemv.cu): two
/// little-endian u32 words (values 0..15, 16..31), value `4i + b` of a word at bits
/// `8b + 2i`, so `(word >> 2i) & 0x03030303` holds values `4i..4i + 4` as bytes.
fn two_bit_plane(codes: &[u8]) -> [u8; 8] {
    let mut words = [0u32; 2];
    for (v, &code) in codes.iter().enumerate() {
        let (h, i, b) = (v / 16, (v % 16) / 4, v % 4);
        words[h] |= u32::from(code & 3) << (8 * b + 2 * i);
    }
    let mut out = [0u8; 8];
    out[..4].copy_from_slice(&words[0].to_le_bytes());
    out[4..].copy_from_slice(&words[1].to_le_bytes());
    out
}

/// Chunk `c`'s 2-bit codes in a Q2_K/Q3_K block's `qs` (ggml: per 128-value half, byte `l`
/// of its 32 holds value `l` of the chunks at shifts 0, 2, 4, 6).
fn k23_codes(qs: &[u8], c: usize) -> [u8; 32] {
    let (half, shift) = (c / 4, 2 * (c % 4));
    std::array::from_fn(|l| (qs[32 * half + l] >> shift) & 3)
}

/// A Q2_K block (84 bytes) in the layout the kernels read (`k23_codes`/`k23_scales`): bytes
/// `8c..8c + 8` chunk `c`'s [`two_bit_plane`]; then `d`, `dmin` and the 16 scale bytes in
/// ggml's order (chunk `c`'s halves at `2c`, `2c + 1`: scale low nibble, min high). The same
/// bytes, reordered.
pub fn q2k_block_for_device(block: &mut [u8]) {
    let ggml: [u8; 84] = (&*block).try_into().expect("84-byte Q2_K block");
    for c in 0..8 {
        block[8 * c..8 * c + 8].copy_from_slice(&two_bit_plane(&k23_codes(&ggml[16..80], c)));
    }
    block[64..68].copy_from_slice(&ggml[80..84]);
    block[68..84].copy_from_slice(&ggml[..16]);
}

/// A Q3_K block (110 bytes) in the layout the kernels read: bytes `8c..8c + 8` chunk `c`'s
/// [`two_bit_plane`] of low bits; bytes `64 + 4c..64 + 4c + 4` its third bits, value `4i + b`
/// at bit `8b + i` of the little-endian word (ggml's hmask bit `c` of byte `l`: set means the
/// code is `low + 4`, read as `code − 4`); `d`; then the sixteen 6-bit scales repacked so a
/// chunk's two are together: byte `c` (0..8) their low nibbles (scale `2c` low, `2c + 1`
/// high), byte `8 + c / 2` their high 2-bit parts at `4·(c mod 2)` (`2c`, then `2c + 1`).
pub fn q3k_block_for_device(block: &mut [u8]) {
    let ggml: [u8; 110] = (&*block).try_into().expect("110-byte Q3_K block");
    let (hmask, qs, scales) = (&ggml[..32], &ggml[32..96], &ggml[96..108]);
    block.fill(0);
    for c in 0..8 {
        block[8 * c..8 * c + 8].copy_from_slice(&two_bit_plane(&k23_codes(qs, c)));
        let mut third = 0u32;
        for (v, &h) in hmask.iter().enumerate() {
            let (i, b) = (v / 4, v % 4);
            third |= u32::from((h >> c) & 1) << (8 * b + i);
        }
        block[64 + 4 * c..68 + 4 * c].copy_from_slice(&third.to_le_bytes());
    }
    block[96..98].copy_from_slice(&ggml[108..110]);
    let biased = |k: usize| (kiln_core::quant::kquants::q3_k_scale(scales, k) + 32) as u8;
    for c in 0..8 {
        let (s0, s1) = (biased(2 * c), biased(2 * c + 1));
        block[98 + c] = (s0 & 15) | ((s1 & 15) << 4);
        block[106 + c / 2] |= ((s0 >> 4) | ((s1 >> 4) << 2)) << (4 * (c % 2));
    }
}

/// Q2_K blocks in the device layout, in place.
fn q2k_blocks_for_device(bytes: &mut [u8]) {
    for block in bytes.chunks_exact_mut(84) {
        q2k_block_for_device(block);
    }
}

/// Q3_K blocks in the device layout, in place.
fn q3k_blocks_for_device(bytes: &mut [u8]) {
    for block in bytes.chunks_exact_mut(110) {
        q3k_block_for_device(block);
    }
}

/// Blocks of `N` bytes whose leading f16 `d` moves to the block's end (IQ2_XS, IQ2_S,
/// IQ3_S: then the fields after `d` start the block, and `body` is a 16-byte multiple).
fn d_to_block_end<const N: usize>(bytes: &mut [u8]) {
    for block in bytes.chunks_exact_mut(N) {
        block.rotate_left(2);
    }
}

const fn sc(offset: usize, bytes: usize) -> Option<Part> {
    Some(Part { offset, bytes })
}

/// Every format the GPU kernels read. The first entry for a type is its plain layout; the
/// row-grouped ones a backend picks by name are statics of their own, listed here too.
pub static FORMATS: [&WeightFormat; 26] = [
    &weight_format!(float F32, "f32", "T_F32", body 4),
    &weight_format!(float F16, "f16", "T_F16", body 2),
    &weight_format!(float BF16, "bf16", "T_BF16", body 2),
    &weight_format!(Q4_0, "q4_0", "T_Q4_0", group 1, body 2 + 16, qh None, sc sc(0, 2)),
    &weight_format!(Q4_1, "q4_1", "T_Q4_1", group 1, body 4 + 16, qh None, sc sc(0, 4)),
    &weight_format!(Q5_0, "q5_0", "T_Q5_0", group 1, body 6 + 16, qh Some(2), sc sc(0, 2)),
    &weight_format!(Q5_1, "q5_1", "T_Q5_1", group 1, body 8 + 16, qh Some(4), sc sc(0, 4)),
    &weight_format!(Q8_0, "q8_0", "T_Q8_0", group 1, body 2 + 32, qh None, sc sc(0, 2)),
    // The 2- and 3-bit K-quants: each chunk's codes together in `body`, the scales in `sc`.
    &weight_format!(Q2_K, "q2_k", "T_Q2_K", group 1, body 0 + 64, qh None, sc sc(64, 20),
        rows "", transcode Some(q2k_blocks_for_device)),
    &weight_format!(Q3_K, "q3_k", "T_Q3_K", group 1, body 0 + 96, qh None, sc sc(96, 14),
        rows "", transcode Some(q3k_blocks_for_device)),
    &weight_format!(Q4_K, "q4_k", "T_Q4_K", group 1, body 0 + 144, qh None, sc None,
        rows "", transcode Some(kquant_blocks_for_device::<144>)),
    &weight_format!(Q5_K, "q5_k", "T_Q5_K", group 1, body 0 + 176, qh None, sc None,
        rows "", transcode Some(kquant_blocks_for_device::<176>)),
    &weight_format!(Q6_K, "q6_k", "T_Q6_K", group 1, body 0 + 208, qh None, sc sc(208, 2),
        rows "", transcode Some(q6k_blocks_for_device)),
    // The I-quants' non-linear 4-bit levels: IQ4_NL is Q4_0's block with a table for the
    // codes; IQ4_XS keeps a super-block's 128 code bytes in `body` and the 8 bytes before
    // them (d, the high scale bits, the low scale nibbles) in `sc`.
    &weight_format!(IQ4_NL, "iq4_nl", "T_IQ4_NL", group 1, body 2 + 16, qh None, sc sc(0, 2)),
    &weight_format!(IQ4_XS, "iq4_xs", "T_IQ4_XS", group 1, body 8 + 128, qh None, sc sc(0, 8)),
    // MXFP4 (gpt-oss's experts): IQ4_NL's kernels with the E2M1 levels and the E8M0
    // exponent byte as the block's scale.
    &weight_format!(MXFP4, "mxfp4", "T_MXFP4", group 1, body 1 + 16, qh None, sc sc(0, 1)),
    // The grid I-quants (gemv.cu's grid_chunk): the block's fields as ggml lays them out,
    // d in `sc`; IQ2_XS, IQ2_S and IQ3_S have their d moved to the block's end at upload,
    // so that the 16-byte multiple `body` holds and the other fields sit in `sc` after it.
    &weight_format!(grid IQ2_XXS, "iq2_xxs", "T_IQ2_XXS", body 2 + 64, sc sc(0, 2), transcode None),
    &weight_format!(grid IQ2_XS, "iq2_xs", "T_IQ2_XS", body 0 + 64, sc sc(64, 10),
        transcode Some(d_to_block_end::<74>)),
    &weight_format!(grid IQ2_S, "iq2_s", "T_IQ2_S", body 0 + 64, sc sc(64, 18),
        transcode Some(d_to_block_end::<82>)),
    &weight_format!(grid IQ3_XXS, "iq3_xxs", "T_IQ3_XXS", body 2 + 96, sc sc(0, 2), transcode None),
    &weight_format!(grid IQ3_S, "iq3_s", "T_IQ3_S", body 0 + 64, sc sc(64, 46),
        transcode Some(d_to_block_end::<110>)),
    &weight_format!(grid IQ1_S, "iq1_s", "T_IQ1_S", body 2 + 48, sc sc(0, 2), transcode None),
    &weight_format!(grid IQ1_M, "iq1_m", "T_IQ1_M", body 0 + 48, sc sc(48, 8), transcode None),
    &Q4_0_X4,
    // APR's 4-bit type: transcoded to Q4_0 blocks at upload, then Q4_0's kernels.
    &weight_format!(AprQ4, "apr_q4", "T_Q4_0", group 1, body 2 + 16, qh None, sc sc(0, 2),
        rows "", transcode Some(apr_q4_to_q4_0)),
    &APR_Q4_X4,
];

/// Q4_0 weights stored in groups of four rows (see the module doc): the `cuda-q4_0`
/// backend's GEMV layout.
pub static Q4_0_X4: WeightFormat = weight_format!(Q4_0, "q4_0x4", "T_Q4_0X4", group 4,
    body 2 + 16, qh None, sc sc(0, 2), rows "_R4", transcode None);
/// APR 4-bit weights, transcoded to Q4_0 and stored in groups of four rows.
pub static APR_Q4_X4: WeightFormat = weight_format!(AprQ4, "apr_q4x4", "T_Q4_0X4", group 4,
    body 2 + 16, qh None, sc sc(0, 2), rows "_R4", transcode Some(apr_q4_to_q4_0));

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
            .copied()
            .find(|f| f.qtype == qtype && f.row_group == 1)
    }

    /// The format named `tag`.
    pub fn by_tag(tag: &str) -> Option<&'static WeightFormat> {
        FORMATS.iter().copied().find(|f| f.tag == tag)
    }

    /// Whether rows are grouped (interleaved) rather than stored one after another.
    pub fn is_grouped(&self) -> bool {
        self.row_group > 1
    }

    /// Whether the batched matmul over this format has the pipelined walk (`BMMP_FOR_*` in
    /// cuda/bmm.cu: whole super-blocks staged through shared memory and dequantised to f16
    /// for the tensor cores, so a batched step rounds these weights' products unlike the
    /// one-sequence GEMVs): Q4_K, Q5_K and Q6_K.
    pub fn has_pipelined_bmm(&self) -> bool {
        self.batched.is_some() && matches!(self.qtype, QType::Q4_K | QType::Q5_K | QType::Q6_K)
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

    /// Every scale and min of every sub-block comes out of the device layout as ggml's
    /// decoder reads it from the file's, for random and extreme bytes (the decoder here
    /// restates gemv.cu's `k4_scale_min_w`).
    #[test]
    fn kquant_device_scales_decode_to_ggml_values() {
        let device_scale_min = |n: &[u8; 12], j: usize| {
            let lo = n[j];
            let hi = (n[8 + j / 2] >> (4 * (j & 1))) & 15;
            ((lo & 15) | ((hi & 3) << 4), (lo >> 4) | ((hi >> 2) << 4))
        };
        let mut rng = kiln_core::Rng::new(crate::testdata::fresh_seed());
        let mut cases: Vec<[u8; 12]> = vec![[0; 12], [0xff; 12], [0x3f; 12], [0xc0; 12]];
        for _ in 0..2000 {
            cases.push(std::array::from_fn(|_| rng.next_u64() as u8));
        }
        for ggml in cases {
            let dev = kquant_scales_for_device(&ggml);
            for j in 0..8 {
                assert_eq!(
                    device_scale_min(&dev, j),
                    kiln_core::quant::kquants::scale_min_k4(&ggml, j),
                    "{ggml:?} sub-block {j}"
                );
            }
        }
    }

    /// Every value of a Q6_K block read from the device layout the way the kernels read it
    /// (restated here) equals what core's dequantiser makes of the file's block.
    #[test]
    fn q6k_device_blocks_decode_to_ggml_values() {
        let mut rng = kiln_core::Rng::new(crate::testdata::fresh_seed());
        for case in 0..500 {
            let mut ggml = [0u8; 210];
            for b in ggml.iter_mut() {
                *b = match case {
                    0 => 0,
                    1 => 0xff,
                    _ => rng.next_u64() as u8,
                };
            }
            // A finite scale: NaN would not compare.
            ggml[208..].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
            let mut expected = [0f32; 256];
            kiln_core::quant::kquants::dequantize_q6_k(&ggml, &mut expected);
            let mut dev = ggml;
            q6k_block_for_device(&mut dev);
            assert_eq!(dev[192..], ggml[192..], "scales and d stay");
            let d = half::f16::from_le_bytes([dev[208], dev[209]]).to_f32();
            for c in 0..8 {
                let word = |k: usize| {
                    u32::from_le_bytes(dev[128 + 8 * c + 4 * k..][..4].try_into().unwrap())
                };
                for v in 0..32 {
                    let low = (dev[16 * c + v % 16] >> (4 * (v / 16))) & 15;
                    let (i, b) = (v / 4, v % 4);
                    let high = ((word(i / 4) >> (2 * (i % 4))) >> (8 * b)) & 3;
                    let code = i32::from(low | ((high as u8) << 4));
                    let scale = f32::from(dev[192 + 2 * c + v / 16] as i8);
                    let value = d * scale * (code - 32) as f32;
                    assert_eq!(
                        value.to_bits(),
                        expected[32 * c + v].to_bits(),
                        "case {case} chunk {c} value {v}"
                    );
                }
            }
        }
    }

    /// Every value of a Q2_K and a Q3_K block read from the device layout the way the
    /// kernels read it (`k23_word` and `k23_scales`, restated here) equals what core's
    /// dequantiser makes of the file's block, for random and extreme bytes.
    #[test]
    fn q2k_q3k_device_blocks_decode_to_ggml_values() {
        let mut rng = kiln_core::Rng::new(crate::testdata::fresh_seed());
        let word = |b: &[u8], at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
        let half = |b: &[u8], at: usize| half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32();
        for case in 0..500 {
            let fill = |len: usize, rng: &mut kiln_core::Rng| -> Vec<u8> {
                (0..len)
                    .map(|_| match case {
                        0 => 0,
                        1 => 0xff,
                        _ => rng.next_u64() as u8,
                    })
                    .collect()
            };
            // Q2_K: finite d and dmin (NaN would not compare).
            let mut q2 = fill(84, &mut rng);
            q2[80..82].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
            q2[82..84].copy_from_slice(&half::f16::from_f32(0.003).to_le_bytes());
            let mut want = [0f32; 256];
            kiln_core::quant::kquants::dequantize_q2_k(q2[..].try_into().unwrap(), &mut want);
            let mut dev = q2.clone();
            q2k_block_for_device(&mut dev);
            let (body, sc) = (&dev[..64], &dev[64..84]);
            for c in 0..8 {
                let plane = [word(body, 8 * c), word(body, 8 * c + 4)];
                let sm = u32::from(u16::from_le_bytes([sc[4 + 2 * c], sc[5 + 2 * c]]));
                let (d, dmin) = (half(sc, 0), half(sc, 2));
                for v in 0..32 {
                    let (i, b) = (v / 4, v % 4);
                    let code = ((plane[i / 4] >> (2 * (i % 4))) >> (8 * b)) & 3;
                    let byte = (sm >> (8 * (v / 16))) & 255;
                    let (s, m) = ((byte & 15) as f32, (byte >> 4) as f32);
                    let value = d * s * code as f32 - dmin * m;
                    let expected = want[32 * c + v];
                    assert!(
                        (value - expected).abs() <= 1e-6 * expected.abs().max(1e-3),
                        "q2_k case {case} chunk {c} value {v}: {value} against {expected}"
                    );
                }
            }
            let mut q3 = fill(110, &mut rng);
            q3[108..110].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
            kiln_core::quant::kquants::dequantize_q3_k(q3[..].try_into().unwrap(), &mut want);
            let mut dev = q3.clone();
            q3k_block_for_device(&mut dev);
            let (body, sc) = (&dev[..96], &dev[96..110]);
            for c in 0..8 {
                let plane = [word(body, 8 * c), word(body, 8 * c + 4)];
                let hb = word(body, 64 + 4 * c);
                let d = half(sc, 0);
                let lo = u32::from(sc[2 + c]);
                let hi = u32::from(sc[10 + c / 2]) >> (4 * (c % 2));
                let s = [
                    ((lo & 15) | ((hi & 3) << 4)) as i32 - 32,
                    ((lo >> 4) | (((hi >> 2) & 3) << 4)) as i32 - 32,
                ];
                for v in 0..32 {
                    let (i, b) = (v / 4, v % 4);
                    let low = ((plane[i / 4] >> (2 * (i % 4))) >> (8 * b)) & 3;
                    let third = ((hb >> i) >> (8 * b)) & 1;
                    let code = (low | (third << 2)) as i32 - 4;
                    let value = d * s[v / 16] as f32 * code as f32;
                    assert_eq!(
                        value.to_bits(),
                        want[32 * c + v].to_bits(),
                        "q3_k case {case} chunk {c} value {v}"
                    );
                }
            }
        }
    }

    /// The level tables the CUDA kernels hold as four words each (`IQ4_LEVELS_*`,
    /// `MXFP4_LEVELS_*` in gemv.cu) are core's `KVALUES_IQ4NL` and MXFP4 `KVALUES`, byte for
    /// byte; and `levels4`' lookup, restated here (a byte_perm of each 8-entry half, then a
    /// per-byte pick by the code's bit 3), maps every code to its level.
    #[test]
    fn level_words_in_the_kernels_are_cores_tables() {
        let tables: [(&str, &[i8; 16]); 2] = [
            ("IQ4", &kiln_core::quant::iquants::KVALUES_IQ4NL),
            ("MXFP4", &kiln_core::quant::mxfp4::KVALUES),
        ];
        for (name, table) in tables {
            let words: Vec<u32> = (0..4)
                .map(|i| {
                    let define = format!("#define {name}_LEVELS_{i} 0x");
                    let at = GEMV_SRC.find(&define).expect("level word") + define.len();
                    u32::from_str_radix(&GEMV_SRC[at..at + 8], 16).expect("hex word")
                })
                .collect();
            let bytes: Vec<i8> = words
                .iter()
                .flat_map(|w| w.to_le_bytes())
                .map(|b| b as i8)
                .collect();
            assert_eq!(bytes, table, "{name}");
            let byte_perm = |x: u32, y: u32, s: u32| -> u32 {
                let src = (u64::from(y) << 32) | u64::from(x);
                (0..4).fold(0, |out, n| {
                    let sel = (s >> (4 * n)) & 7;
                    out | ((((src >> (8 * sel)) & 255) as u32) << (8 * n))
                })
            };
            // Every combination of four codes, one per byte.
            for n in 0..65536u32 {
                let codes = (0..4).fold(0, |w, b| w | (((n >> (4 * b)) & 15) << (8 * b)));
                let sel = (codes & 0xf)
                    | ((codes >> 4) & 0xf0)
                    | ((codes >> 8) & 0xf00)
                    | ((codes >> 12) & 0xf000);
                let lo = byte_perm(words[0], words[1], sel & 0x7777);
                let hi = byte_perm(words[2], words[3], sel & 0x7777);
                let out = byte_perm(lo, hi, 0x3210 | ((sel & 0x8888) >> 1));
                for (b, level) in out.to_le_bytes().into_iter().enumerate() {
                    let code = (codes >> (8 * b)) & 15;
                    assert_eq!(
                        level as i8, table[code as usize],
                        "{name} codes {codes:#010x}, byte {b}"
                    );
                }
            }
        }
    }

    /// The lattices the grid types' modules define (`cuda/iq_grids.cuh`) are core's, row
    /// for row, and ggml's ksigns table is what gemv.cu's `ksigns` computes (the index's
    /// seven signs, the eighth making the count even).
    #[test]
    fn device_grids_are_cores_tables() {
        use kiln_core::quant::iquant_grids as g;
        let header = include_str!("../cuda/iq_grids.cuh");
        let table = |name: &str| -> Vec<u64> {
            let at = header.find(&format!(" {name}[")).expect("table") + name.len();
            let body = &header[at..];
            let body = &body[body.find('{').expect("{") + 1..body.find("};").expect("};")];
            body.split(',')
                .map(str::trim)
                .filter(|v| !v.is_empty())
                .map(|v| u64::from_str_radix(v.trim_start_matches("0x"), 16).expect("hex"))
                .collect()
        };
        let wide = |t: &[u32]| t.iter().map(|&v| v as u64).collect::<Vec<_>>();
        assert_eq!(table("iq2xxs_grid"), g::IQ2XXS_GRID);
        assert_eq!(table("iq2xs_grid"), g::IQ2XS_GRID);
        assert_eq!(table("iq2s_grid"), g::IQ2S_GRID);
        assert_eq!(table("iq3xxs_grid"), wide(&g::IQ3XXS_GRID));
        assert_eq!(table("iq3s_grid"), wide(&g::IQ3S_GRID));
        assert_eq!(table("iq1s_grid"), g::IQ1S_GRID);
        for (i, &k) in g::KSIGNS.iter().enumerate() {
            let i = i as u32;
            assert_eq!(u32::from(k), i | ((i.count_ones() & 1) << 7), "ksigns[{i}]");
        }
    }

    /// gemv.cu's `grid_chunk`, restated: chunk `ib` of a grid-type block read from its
    /// device planes (`body`, `sc` of one block) as the kernel reads them — 32 signed values
    /// and the scales of its halves.
    fn grid_chunk(q: QType, body: &[u8], sc: &[u8], ib: usize) -> ([i32; 32], f32, f32) {
        use kiln_core::quant::iquant_grids as g;
        let h = |b: &[u8], at: usize| {
            half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
        };
        let u16_at = |b: &[u8], at: usize| u32::from(u16::from_le_bytes([b[at], b[at + 1]]));
        let u32_at = |b: &[u8], at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
        let ksigns = |i: u32| i | ((i.count_ones() & 1) << 7);
        let mut v = [0i32; 32];
        // Eight grid bytes (as unsigned magnitudes, or IQ1's signed −1/0/1) at 8l.. with signs.
        let group8 = |l: usize, row: u64, signs: u32, v: &mut [i32; 32]| {
            for j in 0..8 {
                let m = ((row >> (8 * j)) & 255) as i32;
                v[8 * l + j] = if (signs >> j) & 1 == 1 { -m } else { m };
            }
        };
        let (s0, s1);
        match q {
            QType::IQ2_XXS => {
                let (idx, aux) = (u32_at(body, 8 * ib), u32_at(body, 8 * ib + 4));
                s0 = h(sc, 0) * (0.5 + (aux >> 28) as f32) * 0.25;
                s1 = s0;
                for l in 0..4 {
                    let row = g::IQ2XXS_GRID[((idx >> (8 * l)) & 255) as usize];
                    group8(l, row, ksigns((aux >> (7 * l)) & 127), &mut v);
                }
            }
            QType::IQ2_XS | QType::IQ2_S => {
                let (scales_at, d_at) = if q == QType::IQ2_XS { (0, 8) } else { (8, 16) };
                let ls = u32::from(sc[scales_at + ib]);
                let d = h(sc, d_at);
                s0 = d * (0.5 + (ls & 15) as f32) * 0.25;
                s1 = d * (0.5 + (ls >> 4) as f32) * 0.25;
                for l in 0..4 {
                    let i = 4 * ib + l;
                    if q == QType::IQ2_XS {
                        let w = u16_at(body, 2 * i);
                        group8(l, g::IQ2XS_GRID[(w & 511) as usize], ksigns(w >> 9), &mut v);
                    } else {
                        let top = (u32::from(sc[ib]) >> (2 * l)) & 3;
                        let row = g::IQ2S_GRID[(u32::from(body[i]) | (top << 8)) as usize];
                        group8(l, row, u32::from(body[32 + i]), &mut v);
                    }
                }
            }
            QType::IQ3_XXS => {
                let aux = u32_at(body, 64 + 4 * ib);
                s0 = h(sc, 0) * (0.5 + (aux >> 28) as f32) * 0.5;
                s1 = s0;
                for j in 0..8 {
                    let row = u64::from(g::IQ3XXS_GRID[body[8 * ib + j] as usize]);
                    let signs = ksigns((aux >> (7 * (j / 2))) & 127) >> (4 * (j % 2));
                    for k in 0..4 {
                        let m = ((row >> (8 * k)) & 255) as i32;
                        v[4 * j + k] = if (signs >> k) & 1 == 1 { -m } else { m };
                    }
                }
            }
            QType::IQ3_S => {
                let ls = (u32::from(sc[40 + ib / 2]) >> (4 * (ib % 2))) & 15;
                s0 = h(sc, 44) * (1 + 2 * ls) as f32;
                s1 = s0;
                for j in 0..8 {
                    let idx = u32::from(body[8 * ib + j]) | (((u32::from(sc[ib]) >> j) & 1) << 8);
                    let row = u64::from(g::IQ3S_GRID[idx as usize]);
                    let signs = u32::from(sc[8 + 4 * ib + j / 2]) >> (4 * (j % 2));
                    for k in 0..4 {
                        let m = ((row >> (8 * k)) & 255) as i32;
                        v[4 * j + k] = if (signs >> k) & 1 == 1 { -m } else { m };
                    }
                }
            }
            QType::IQ1_S | QType::IQ1_M => {
                let iq1 = |row: u64, minus: bool, l: usize, v: &mut [i32; 32]| {
                    for j in 0..8 {
                        let gv = ((row >> (8 * j)) & 255) as u8 as i8 as i32;
                        v[8 * l + j] = 8 * gv + if minus { -1 } else { 1 };
                    }
                };
                if q == QType::IQ1_S {
                    let qh = u16_at(body, 32 + 2 * ib);
                    s0 = h(sc, 0) * (2 * ((qh >> 12) & 7) + 1) as f32 * 0.125;
                    s1 = s0;
                    for l in 0..4 {
                        let idx = u32::from(body[4 * ib + l]) | (((qh >> (3 * l)) & 7) << 8);
                        iq1(g::IQ1S_GRID[idx as usize], qh & 0x8000 != 0, l, &mut v);
                    }
                } else {
                    let (s01, s23) = (u32_at(sc, 0), u32_at(sc, 4));
                    let dbits = ((s01 >> 12) & 0xf)
                        | ((s01 >> 24) & 0xf0)
                        | ((s23 >> 4) & 0xf00)
                        | ((s23 >> 16) & 0xf000);
                    let d = half::f16::from_bits(dbits as u16).to_f32();
                    let sk = if ib < 4 { s01 } else { s23 };
                    let k0 = 2 * ib;
                    let half = if (k0 / 4) & 1 == 1 {
                        sk >> 16
                    } else {
                        sk & 0xffff
                    };
                    s0 = d * (2 * ((half >> (3 * (k0 % 4))) & 7) + 1) as f32 * 0.125;
                    s1 = d * (2 * ((half >> (3 * (k0 % 4 + 1))) & 7) + 1) as f32 * 0.125;
                    for l in 0..4 {
                        let i = 4 * ib + l;
                        let nib = (u32::from(body[32 + i / 2]) >> (4 * (i % 2))) & 15;
                        let idx = u32::from(body[i]) | ((nib & 7) << 8);
                        iq1(g::IQ1S_GRID[idx as usize], nib & 8 != 0, l, &mut v);
                    }
                }
            }
            other => panic!("{other} is not a grid type"),
        }
        (v, s0, s1)
    }

    /// Every value of random grid-type blocks, read from the device planes as `grid_chunk`
    /// reads them (the blocks transcoded and split as the upload does), is core's
    /// dequantised value bit for bit, and each fits the signed bytes the kernels hold.
    #[test]
    fn grid_chunks_from_the_device_layout_are_cores_values() {
        let mut rng = kiln_core::Rng::new(11);
        for f in FORMATS.iter().filter(|f| {
            matches!(
                f.qtype,
                QType::IQ2_XXS
                    | QType::IQ2_XS
                    | QType::IQ2_S
                    | QType::IQ3_XXS
                    | QType::IQ3_S
                    | QType::IQ1_S
                    | QType::IQ1_M
            )
        }) {
            let q = f.qtype;
            let blocks = 64;
            let mut ggml: Vec<u8> = (0..blocks * q.block_bytes())
                .map(|_| (rng.next_u64() >> 56) as u8)
                .collect();
            // Finite scales: d (IQ1_M's assembled from nibbles) a modest f16.
            for b in ggml.chunks_exact_mut(q.block_bytes()) {
                if q == QType::IQ1_M {
                    for k in 0..4 {
                        b[48 + 2 * k + 1] &= 0x3F;
                    }
                } else {
                    b[1] &= 0x3F;
                }
            }
            let packed = crate::repack::PackedWeight::pack_as(f, 256, blocks, &ggml).unwrap();
            let mut want = vec![0f32; 256 * blocks];
            kiln_core::quant::dequantize(q, &ggml, &mut want).unwrap();
            let (bb, sb) = (f.body.bytes, f.sc.map_or(0, |s| s.bytes));
            for blk in 0..blocks {
                let (body, sc) = (&packed.body[blk * bb..][..bb], &packed.sc[blk * sb..][..sb]);
                for ib in 0..8 {
                    let (v, s0, s1) = grid_chunk(q, body, sc, ib);
                    for (j, &x) in v.iter().enumerate() {
                        assert!((-128..=127).contains(&x), "{} value {x}", f.tag);
                        let got = if j < 16 { s0 } else { s1 } * x as f32;
                        let w = want[256 * blk + 32 * ib + j];
                        assert_eq!(
                            got.to_bits(),
                            w.to_bits(),
                            "{} block {blk} chunk {ib} value {j}: {got} vs {w}",
                            f.tag
                        );
                    }
                }
            }
        }
    }

    /// Each format's parts are what gemv.cu's `Traits` for its type says a block holds: the
    /// values a block, the body's bytes and the scale entry's (the kernels index the planes
    /// by these).
    #[test]
    fn cuda_traits_match_the_formats_parts() {
        for f in &FORMATS {
            let decl = format!(
                "struct Traits<{}> {{ static const int BLOCK = ",
                f.cuda_type
            );
            let at = GEMV_SRC
                .find(&decl)
                .unwrap_or_else(|| panic!("Traits of {}", f.cuda_type))
                + decl.len();
            let line = &GEMV_SRC[at..at + GEMV_SRC[at..].find(';').expect(";")];
            let nums: Vec<usize> = line
                .split(',')
                .map(|p| {
                    p.rsplit('=')
                        .next()
                        .unwrap()
                        .trim()
                        .parse()
                        .expect("a number")
                })
                .collect();
            let (block, body, sc) = (nums[0], nums[1], nums[2]);
            assert_eq!(block, f.qtype.block_len(), "{} BLOCK", f.tag);
            assert_eq!(body, f.body.bytes, "{} BODY", f.tag);
            assert_eq!(sc, f.sc.map_or(0, |s| s.bytes), "{} SC", f.tag);
        }
    }

    /// `has_pipelined_bmm` names exactly the formats bmm.cu compiles pipelined entries for.
    #[test]
    fn pipelined_batched_formats_are_those_bmm_cu_compiles() {
        let bmm = include_str!("../cuda/bmm.cu");
        for f in FORMATS.iter().filter(|f| f.batched.is_some()) {
            let entry = format!(
                "#define BMMP_FOR_{}(NAME, T) BMMP_TYPE(NAME, T)",
                f.cuda_type
            );
            assert_eq!(bmm.contains(&entry), f.has_pipelined_bmm(), "{}", f.tag);
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
        assert!(FORMATS.contains(&&Q4_0_X4) && FORMATS.contains(&&APR_Q4_X4));
    }
}
