//! APR v2, the container format of aprender (and realizar): a zero-copy reader over a memory
//! map, with bounded decompression for compressed files, and a streaming writer.
//!
//! Layout (little-endian; `docs/formats.md §6.2` has the full description and the reasons):
//!
//! ```text
//! 0   magic "APR\0" (older writers: "APR2")     4  version major u8     5  version minor u8
//! 6   flags u16                                 8  tensor_count u32
//! 12  metadata_offset u64 (64)                  20 metadata_size u32
//! 24  tensor_index_offset u64                   32 data_offset u64
//! 40  header CRC32 u32 (over bytes 0..40 and 44..64)                 44 reserved, 20 bytes
//! 64  JSON metadata (an object), zero-padded to a multiple of 64
//!     tensor index, sorted by name: name_len u16, name, dtype u8, ndim u8, dims u64 × ndim,
//!     offset u64, size u64; zero-padded to a multiple of 64
//!     tensor data: each tensor at a 64-byte aligned offset relative to data_offset
//!     CRC32 of every byte before it, u32
//! ```
//!
//! With the LZ4 or ZSTD flag, the 64-byte header stays as it is and everything after it
//! (metadata, index, data *and* the trailing CRC) is one compressed stream (an LZ4 frame or
//! a zstd frame). Every offset in the header refers to the reconstructed stream
//! `header ‖ decompressed`, which is then read exactly as an uncompressed file; this is how
//! realizar's loader reads compressed APR files (it rebuilds `header + decompressed payload`).
//!
//! The reader treats every file as hostile: both CRCs are checked, every offset and size is
//! checked against the section it must lie in, sizes must equal `dtype × dims` computed with
//! checked arithmetic, tensors must be aligned and may not overlap, and decompression stops
//! at a limit derived from the header and the compressed size, so a small file cannot expand
//! without bound. Nothing is allocated from a size field that has not been checked.

mod reader;
mod writer;

pub use reader::{json_kind, AprFile, AprReadOptions};
pub use writer::{write_apr, AprTensorSpec};

use kiln_core::QType;

/// `APR\0`, the magic kiln writes.
pub const MAGIC: [u8; 4] = *b"APR\0";
/// `APR2`, the magic of older writers (and realizar's constant); accepted when reading.
pub const MAGIC_LEGACY: [u8; 4] = *b"APR2";
/// Bytes in the fixed header.
pub const HEADER_SIZE: usize = 64;
/// Alignment of the sections and of every tensor's data.
pub const ALIGNMENT: u64 = 64;
/// Longest tensor name, in bytes (aprender's `MAX_TENSOR_NAME_LEN`).
pub const MAX_NAME_LEN: usize = 256;
/// Most dimensions a tensor may have (aprender's writer stores at most 8).
pub const MAX_DIMS: usize = 8;
/// The version kiln writes; the reader accepts any 2.x.
pub const VERSION: (u8, u8) = (2, 0);

/// Header flag bits.
pub mod flags {
    /// Everything after the header is one LZ4 frame.
    pub const LZ4: u16 = 0x0001;
    /// Everything after the header is one zstd frame.
    pub const ZSTD: u16 = 0x0002;
    /// The payload is encrypted (AES-256-GCM in aprender). Refused.
    pub const ENCRYPTED: u16 = 0x0004;
    /// The file carries an Ed25519 signature. Refused: kiln has no verification keys.
    pub const SIGNED: u16 = 0x0008;
    /// One shard of a multi-file model. Refused.
    pub const SHARDED: u16 = 0x0010;
    /// Some tensors are quantized (informational).
    pub const QUANTIZED: u16 = 0x0020;
    /// Has an embedded filterbank (aprender, Whisper models; informational).
    pub const HAS_FILTERBANK: u16 = 0x0040;
    /// Has a model card (aprender; informational).
    pub const HAS_MODEL_CARD: u16 = 0x0080;
    /// Supports streaming / chunked loading (aprender; informational).
    pub const STREAMING: u16 = 0x0100;
    /// The metadata carries the vocabulary (informational).
    pub const HAS_VOCAB: u16 = 0x0200;
    /// Tensors are row-major: the last dimension is contiguous. Set by every writer since
    /// aprender's LAYOUT-002; files without it are row-major as well.
    pub const ROW_MAJOR: u16 = 0x0400;
    /// Column-major tensors (an untransposed GGUF import). Refused, as aprender refuses it.
    pub const COLUMN_MAJOR: u16 = 0x0800;
    /// Every bit with a known meaning; any other bit makes the reader refuse the file.
    pub const KNOWN: u16 = 0x0FFF;
}

/// True when `prefix` starts with either APR v2 magic.
pub fn is_apr(prefix: &[u8]) -> bool {
    prefix.len() >= 4 && (prefix[..4] == MAGIC || prefix[..4] == MAGIC_LEGACY)
}

/// Everything that can be wrong with an APR file (or with what the writer was given).
#[derive(Debug, thiserror::Error)]
pub enum AprError {
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("{path}: not a regular file ({kind}); APR files are opened only as regular files")]
    NotRegularFile {
        path: std::path::PathBuf,
        kind: &'static str,
    },
    #[error("file ends inside the {what}: it needs {need} bytes, the file has {have}")]
    Truncated {
        what: &'static str,
        need: u64,
        have: u64,
    },
    #[error("not an APR v2 file: magic bytes are {0:02x?}, expected \"APR\\0\" (or \"APR2\")")]
    BadMagic([u8; 4]),
    #[error("APR version {major}.{minor} is not supported (only 2.x)")]
    UnsupportedVersion { major: u8, minor: u8 },
    #[error("header CRC32 mismatch: the header records {expected:#010x}, its bytes hash to {found:#010x}")]
    HeaderCrc { expected: u32, found: u32 },
    #[error(
        "file CRC32 mismatch: the trailing checksum is {expected:#010x}, the bytes before it hash to {found:#010x}"
    )]
    FileCrc { expected: u32, found: u32 },
    #[error("APR flag {flag} is set and kiln refuses it: {why}")]
    Refused { flag: &'static str, why: String },
    #[error("section layout: {0}")]
    Layout(String),
    #[error("metadata: {0}")]
    Metadata(String),
    #[error("tensor index: {0}")]
    Index(String),
    #[error("decompression failed: {0}")]
    Decompress(String),
    #[error("the decompressed {what} exceeds the limit of {limit} bytes")]
    TooLarge { what: &'static str, limit: u64 },
    #[error("could not allocate {bytes} bytes for the decompressed file")]
    OutOfMemory { bytes: u64 },
    #[error("invalid tensor spec: {0}")]
    InvalidSpec(String),
    #[error("tensor '{name}': the writer callback wrote {written} bytes, its dtype and dims need {expected}")]
    TensorData {
        name: String,
        expected: u64,
        written: u64,
    },
}

impl From<AprError> for kiln_core::Error {
    fn from(e: AprError) -> Self {
        match e {
            AprError::Io(io) => kiln_core::Error::Io(io),
            e @ (AprError::Refused { .. } | AprError::UnsupportedVersion { .. }) => {
                kiln_core::Error::Unsupported(format!("APR: {e}"))
            }
            e @ AprError::OutOfMemory { .. } => kiln_core::Error::OutOfMemory(format!("APR: {e}")),
            e @ (AprError::InvalidSpec(_)
            | AprError::TensorData { .. }
            | AprError::NotRegularFile { .. }) => {
                kiln_core::Error::InvalidArgument(format!("APR: {e}"))
            }
            other => kiln_core::Error::Format(format!("APR: {other}")),
        }
    }
}

/// A tensor's element type. APR reuses ggml's type ids for the types the two share, and
/// gives ids 3–7 (ggml's Q4_1, two removed ids, Q5_0, Q5_1) to its own plain types, so
/// ggml Q4_1/Q5_0/Q5_1 (and Q8_1/Q8_K) cannot be stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AprDtype {
    /// F32 0, F16 1, Q4_0 2, Q8_0 8, Q2_K 10, Q3_K 11, Q4_K 12, Q5_K 13, Q6_K 14, BF16 30.
    Ggml(QType),
    /// id 3
    F64,
    /// id 4
    I32,
    /// id 5
    I64,
    /// id 6
    I8,
    /// id 7
    U8,
    /// aprender's 4-bit format, id 128: per 32 values an f16 scale and 16 bytes of nibbles
    /// (`q + 8`, element `i` in the low nibble when `i` is even); a partial last block is
    /// zero-padded, so `n` values take `ceil(n / 32) × 18` bytes.
    Q4,
    /// aprender's 8-bit format, id 129: one f32 scale for the whole tensor, then one i8 per
    /// value: `4 + n` bytes (an empty tensor takes 0 bytes, as aprender writes it).
    Q8,
}

/// The ggml types APR can hold, by id.
const GGML_IN_APR: [QType; 10] = [
    QType::F32,
    QType::F16,
    QType::Q4_0,
    QType::Q8_0,
    QType::Q2_K,
    QType::Q3_K,
    QType::Q4_K,
    QType::Q5_K,
    QType::Q6_K,
    QType::BF16,
];

impl AprDtype {
    /// Every dtype APR can store, in id order.
    pub const ALL: [AprDtype; 17] = [
        AprDtype::Ggml(QType::F32),
        AprDtype::Ggml(QType::F16),
        AprDtype::Ggml(QType::Q4_0),
        AprDtype::F64,
        AprDtype::I32,
        AprDtype::I64,
        AprDtype::I8,
        AprDtype::U8,
        AprDtype::Ggml(QType::Q8_0),
        AprDtype::Ggml(QType::Q2_K),
        AprDtype::Ggml(QType::Q3_K),
        AprDtype::Ggml(QType::Q4_K),
        AprDtype::Ggml(QType::Q5_K),
        AprDtype::Ggml(QType::Q6_K),
        AprDtype::Ggml(QType::BF16),
        AprDtype::Q4,
        AprDtype::Q8,
    ];

    /// The id stored in the index. For a ggml type APR cannot hold (Q4_1, Q5_0, Q5_1, Q8_1,
    /// Q8_K) this is the ggml id, which means something else in APR: check
    /// [`AprDtype::is_storable`] first (the writer does).
    pub fn id(self) -> u8 {
        match self {
            AprDtype::Ggml(q) => q.ggml_id() as u8,
            AprDtype::F64 => 3,
            AprDtype::I32 => 4,
            AprDtype::I64 => 5,
            AprDtype::I8 => 6,
            AprDtype::U8 => 7,
            AprDtype::Q4 => 128,
            AprDtype::Q8 => 129,
        }
    }

    /// The dtype an index id names. Ids 9 and 15 (ggml Q8_1/Q8_K; 9 was also aprender's
    /// pre-GH-438 id for its Q8) and everything else unlisted are `None`.
    pub fn from_id(id: u8) -> Option<AprDtype> {
        Some(match id {
            3 => AprDtype::F64,
            4 => AprDtype::I32,
            5 => AprDtype::I64,
            6 => AprDtype::I8,
            7 => AprDtype::U8,
            128 => AprDtype::Q4,
            129 => AprDtype::Q8,
            _ => AprDtype::Ggml(
                GGML_IN_APR
                    .iter()
                    .copied()
                    .find(|q| q.ggml_id() == u32::from(id))?,
            ),
        })
    }

    /// Whether the dtype round-trips through its id (false for ggml Q4_1/Q5_0/Q5_1/Q8_1/Q8_K).
    pub fn is_storable(self) -> bool {
        AprDtype::from_id(self.id()) == Some(self)
    }

    /// Lower-case name: ggml's name for ggml types, `apr_q4`/`apr_q8` for aprender's own.
    pub fn name(self) -> String {
        match self {
            AprDtype::Ggml(q) => q.name().to_string(),
            AprDtype::F64 => "f64".into(),
            AprDtype::I32 => "i32".into(),
            AprDtype::I64 => "i64".into(),
            AprDtype::I8 => "i8".into(),
            AprDtype::U8 => "u8".into(),
            AprDtype::Q4 => "apr_q4".into(),
            AprDtype::Q8 => "apr_q8".into(),
        }
    }

    /// Whether values are quantized (sets the QUANTIZED flag when written).
    pub fn is_quantized(self) -> bool {
        match self {
            AprDtype::Ggml(q) => q.is_quantized(),
            AprDtype::Q4 | AprDtype::Q8 => true,
            _ => false,
        }
    }

    /// Bytes that `elements` values take, or `None` when no size fits: a ggml block type
    /// and a count that is not a whole number of blocks, or a size that overflows `u64`.
    pub fn byte_size(self, elements: u64) -> Option<u64> {
        match self {
            AprDtype::Ggml(q) => {
                let block = q.block_len() as u64;
                if !elements.is_multiple_of(block) {
                    return None;
                }
                (elements / block).checked_mul(q.block_bytes() as u64)
            }
            AprDtype::F64 | AprDtype::I64 => elements.checked_mul(8),
            AprDtype::I32 => elements.checked_mul(4),
            AprDtype::I8 | AprDtype::U8 => Some(elements),
            AprDtype::Q4 => elements.div_ceil(32).checked_mul(18),
            AprDtype::Q8 => {
                if elements == 0 {
                    Some(0)
                } else {
                    elements.checked_add(4)
                }
            }
        }
    }
}

impl std::fmt::Display for AprDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

/// One entry of the tensor index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AprTensorInfo {
    pub name: String,
    pub dtype: AprDtype,
    /// As stored: row-major, the LAST dimension is contiguous (the reverse of ggml order).
    pub dims: Vec<u64>,
    /// Offset of the first byte, relative to the start of the data section.
    pub offset: u64,
    /// Bytes of data (always `dtype.byte_size(elements)` in a file the reader accepted).
    pub size: u64,
}

impl AprTensorInfo {
    /// Product of the dims (1 for a scalar). Cannot overflow for an entry the reader
    /// accepted.
    pub fn elements(&self) -> u64 {
        self.dims
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .unwrap_or(u64::MAX)
    }
}

/// How the part of the file after the header is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    /// One LZ4 frame (frame format, with a content checksum when kiln writes it).
    Lz4,
    /// One zstd frame (with a content checksum when kiln writes it).
    Zstd,
}

/// The fixed 64-byte header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AprHeader {
    pub magic: [u8; 4],
    pub version: (u8, u8),
    pub flags: u16,
    pub tensor_count: u32,
    pub metadata_offset: u64,
    pub metadata_size: u32,
    pub tensor_index_offset: u64,
    pub data_offset: u64,
    /// The CRC32 the header records (bytes 40..44).
    pub checksum: u32,
    pub reserved: [u8; 20],
}

impl AprHeader {
    /// Decodes the fields; checks nothing.
    pub fn parse(b: &[u8; HEADER_SIZE]) -> AprHeader {
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u64_at = |o: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[o..o + 8]);
            u64::from_le_bytes(a)
        };
        let mut reserved = [0u8; 20];
        reserved.copy_from_slice(&b[44..64]);
        AprHeader {
            magic: [b[0], b[1], b[2], b[3]],
            version: (b[4], b[5]),
            flags: u16::from_le_bytes([b[6], b[7]]),
            tensor_count: u32_at(8),
            metadata_offset: u64_at(12),
            metadata_size: u32_at(20),
            tensor_index_offset: u64_at(24),
            data_offset: u64_at(32),
            checksum: u32_at(40),
            reserved,
        }
    }

    /// Encodes the fields as they are (including `checksum`).
    pub fn to_bytes(&self) -> [u8; HEADER_SIZE] {
        let mut b = [0u8; HEADER_SIZE];
        b[0..4].copy_from_slice(&self.magic);
        b[4] = self.version.0;
        b[5] = self.version.1;
        b[6..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..12].copy_from_slice(&self.tensor_count.to_le_bytes());
        b[12..20].copy_from_slice(&self.metadata_offset.to_le_bytes());
        b[20..24].copy_from_slice(&self.metadata_size.to_le_bytes());
        b[24..32].copy_from_slice(&self.tensor_index_offset.to_le_bytes());
        b[32..40].copy_from_slice(&self.data_offset.to_le_bytes());
        b[40..44].copy_from_slice(&self.checksum.to_le_bytes());
        b[44..64].copy_from_slice(&self.reserved);
        b
    }
}

/// The header CRC: IEEE CRC32 over bytes 0..40 and 44..64 (the checksum field skipped).
pub fn header_crc(header: &[u8; HEADER_SIZE]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&header[..40]);
    h.update(&header[44..]);
    h.finalize()
}

/// Rounds `n` up to the next multiple of [`ALIGNMENT`].
pub(crate) fn align64(n: u64) -> Option<u64> {
    n.checked_add(ALIGNMENT - 1).map(|v| v & !(ALIGNMENT - 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_ids_round_trip() {
        for d in AprDtype::ALL {
            assert_eq!(AprDtype::from_id(d.id()), Some(d), "{d}");
            assert!(d.is_storable());
        }
        for q in [
            QType::Q4_1,
            QType::Q5_0,
            QType::Q5_1,
            QType::Q8_1,
            QType::Q8_K,
        ] {
            assert!(!AprDtype::Ggml(q).is_storable(), "{q}");
        }
        assert_eq!(AprDtype::from_id(9), None);
        assert_eq!(AprDtype::from_id(15), None);
        assert_eq!(AprDtype::from_id(8), Some(AprDtype::Ggml(QType::Q8_0)));
    }

    #[test]
    fn byte_sizes() {
        assert_eq!(AprDtype::Q4.byte_size(32), Some(18));
        assert_eq!(AprDtype::Q4.byte_size(33), Some(36));
        assert_eq!(AprDtype::Q4.byte_size(0), Some(0));
        assert_eq!(AprDtype::Q8.byte_size(10), Some(14));
        assert_eq!(AprDtype::Q8.byte_size(0), Some(0));
        assert_eq!(AprDtype::Ggml(QType::Q4_K).byte_size(512), Some(288));
        assert_eq!(AprDtype::Ggml(QType::Q4_K).byte_size(100), None);
        assert_eq!(AprDtype::F64.byte_size(u64::MAX / 4), None);
        assert_eq!(AprDtype::Q8.byte_size(u64::MAX), None);
        assert_eq!(
            AprDtype::Q4.byte_size(u64::MAX),
            Some(u64::MAX.div_ceil(32) * 18)
        );
        assert_eq!(AprDtype::Ggml(QType::F32).byte_size(u64::MAX / 2), None);
    }

    #[test]
    fn header_round_trips() {
        let h = AprHeader {
            magic: MAGIC,
            version: (2, 0),
            flags: 0x0421,
            tensor_count: 7,
            metadata_offset: 64,
            metadata_size: 99,
            tensor_index_offset: 192,
            data_offset: 512,
            checksum: 0xDEAD_BEEF,
            reserved: [0; 20],
        };
        assert_eq!(AprHeader::parse(&h.to_bytes()), h);
    }
}
