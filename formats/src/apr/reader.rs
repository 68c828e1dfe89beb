//! Opening and validating APR v2 files.

use std::fs::File;
use std::io::Read;
use std::path::Path;
use std::sync::Arc;

use kiln_core::Storage;
use serde_json::{Map, Value};

use super::{
    align64, flags, header_crc, AprDtype, AprError, AprHeader, AprTensorInfo, Compression,
    ALIGNMENT, HEADER_SIZE, MAGIC, MAGIC_LEGACY, MAX_DIMS, MAX_NAME_LEN,
};

/// zstd frame magic (`28 B5 2F FD`).
const ZSTD_MAGIC: [u8; 4] = [0x28, 0xB5, 0x2F, 0xFD];
/// LZ4 frame magic (`04 22 4D 18`).
const LZ4_FRAME_MAGIC: [u8; 4] = [0x04, 0x22, 0x4D, 0x18];
/// Smallest index entry: name_len, a 1-byte name, dtype, ndim, offset, size.
const MIN_ENTRY: u64 = 2 + 1 + 1 + 1 + 8 + 8;
/// How much longer than its index describes a decompressed stream may be.
const DECOMPRESS_SLACK: u64 = 64 * 1024;

/// Knobs for reading. [`Default`] is what [`AprFile::open`] and [`AprFile::from_bytes`] use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AprReadOptions {
    /// Check the trailing CRC32 (reads every byte of the file once). Default: true.
    pub verify_file_crc: bool,
    /// A compressed file may always expand to this many bytes (header included). Default 256 MiB.
    pub decompress_floor: u64,
    /// ... and to this many times its own size, if that is more. Default 1000.
    pub decompress_ratio: u64,
    /// ... but never past this. Default 64 GiB.
    pub decompress_ceiling: u64,
}

impl Default for AprReadOptions {
    fn default() -> Self {
        AprReadOptions {
            verify_file_crc: true,
            decompress_floor: 256 << 20,
            decompress_ratio: 1000,
            decompress_ceiling: 64 << 30,
        }
    }
}

impl AprReadOptions {
    /// The most bytes (header included) a compressed file of `compressed_len` bytes may
    /// expand to: `min(ceiling, max(floor, ratio × compressed_len))`. Once the index is
    /// decoded, the reader tightens this to what the index describes (see the module docs).
    pub fn decompress_limit(&self, compressed_len: u64) -> u64 {
        self.decompress_ratio
            .saturating_mul(compressed_len)
            .max(self.decompress_floor)
            .min(self.decompress_ceiling)
    }
}

/// An opened, validated APR v2 file. Tensor bytes are borrowed from [`AprFile::storage`]:
/// the memory map for an uncompressed file, the decompressed bytes (64-byte aligned) for a
/// compressed one.
pub struct AprFile {
    storage: Arc<dyn Storage>,
    header: AprHeader,
    compression: Compression,
    metadata: Map<String, Value>,
    tensors: Vec<AprTensorInfo>,
}

impl std::fmt::Debug for AprFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AprFile")
            .field("version", &self.header.version)
            .field("flags", &format_args!("{:#06x}", self.header.flags))
            .field("compression", &self.compression)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("bytes", &self.storage.len())
            .finish()
    }
}

impl AprFile {
    /// Opens `path`: memory-maps an uncompressed file (tensor data is not read beyond the
    /// CRC check), decompresses a compressed one into memory within the limits of
    /// [`AprReadOptions::default`]. Anything but a regular file (a FIFO, a device, a
    /// directory) is refused before it is opened for reading.
    pub fn open(path: impl AsRef<Path>) -> Result<AprFile, AprError> {
        AprFile::open_with(path, &AprReadOptions::default())
    }

    /// [`AprFile::open`] with explicit options.
    pub fn open_with(path: impl AsRef<Path>, opts: &AprReadOptions) -> Result<AprFile, AprError> {
        let path = path.as_ref();
        check_regular(path, &std::fs::metadata(path)?)?;
        let file = File::open(path)?;
        // The path could have been swapped between the check and the open; check what was
        // actually opened as well (opening a regular file never blocks).
        let meta = file.metadata()?;
        check_regular(path, &meta)?;
        if meta.len() < HEADER_SIZE as u64 {
            // An empty mapping is refused by some platforms; read the few bytes instead.
            let mut bytes = Vec::new();
            file.take(HEADER_SIZE as u64).read_to_end(&mut bytes)?;
            return AprFile::from_storage_with(Arc::new(bytes), opts);
        }
        // SAFETY: the map is read-only. Another process truncating or rewriting the file
        // while it is mapped is outside what any mmap-based reader can defend against; the
        // GGUF reader (and llama.cpp, candle) accept the same contract.
        let map = unsafe { memmap2::Mmap::map(&file)? };
        AprFile::from_storage_with(Arc::new(map), opts)
    }

    /// Parses an APR file held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<AprFile, AprError> {
        AprFile::from_storage_with(Arc::new(bytes), &AprReadOptions::default())
    }

    /// [`AprFile::from_bytes`] with explicit options.
    pub fn from_bytes_with(bytes: Vec<u8>, opts: &AprReadOptions) -> Result<AprFile, AprError> {
        AprFile::from_storage_with(Arc::new(bytes), opts)
    }

    /// Parses APR bytes already in memory or mapped by the caller.
    pub fn from_storage(storage: Arc<dyn Storage>) -> Result<AprFile, AprError> {
        AprFile::from_storage_with(storage, &AprReadOptions::default())
    }

    /// [`AprFile::from_storage`] with explicit options.
    pub fn from_storage_with(
        raw: Arc<dyn Storage>,
        opts: &AprReadOptions,
    ) -> Result<AprFile, AprError> {
        let header = read_header(&raw)?;
        let compression = detect_compression(&raw, header.flags);
        let storage: Arc<dyn Storage> = match compression {
            Compression::None => raw,
            codec => {
                let bytes = decompress(&raw, &header, codec, opts)?;
                drop(raw);
                Arc::new(bytes)
            }
        };
        let (metadata, tensors) = parse_body(&storage, &header, opts.verify_file_crc)?;
        Ok(AprFile {
            storage,
            header,
            compression,
            metadata,
            tensors,
        })
    }

    /// `(major, minor)`.
    pub fn version(&self) -> (u8, u8) {
        self.header.version
    }

    /// The header's flag bits (see [`super::flags`]).
    pub fn flags(&self) -> u16 {
        self.header.flags
    }

    /// The decoded header.
    pub fn header(&self) -> &AprHeader {
        &self.header
    }

    /// How the file was actually stored. `None` also for a file whose LZ4/ZSTD flag is set
    /// over an uncompressed payload, as aprender's `with_lz4_compression` writes them.
    pub fn compression(&self) -> Compression {
        self.compression
    }

    /// The JSON metadata object.
    pub fn metadata(&self) -> &Map<String, Value> {
        &self.metadata
    }

    /// The tensor index, sorted by name.
    pub fn tensors(&self) -> &[AprTensorInfo] {
        &self.tensors
    }

    /// The tensor named `name` (binary search: the index is sorted).
    pub fn tensor(&self, name: &str) -> Option<&AprTensorInfo> {
        self.tensors
            .binary_search_by(|t| t.name.as_str().cmp(name))
            .ok()
            .map(|i| &self.tensors[i])
    }

    /// Absolute offset of the data section in [`AprFile::storage`].
    pub fn data_offset(&self) -> u64 {
        self.header.data_offset
    }

    /// Absolute offset of tensor `t`'s first byte in [`AprFile::storage`].
    pub fn tensor_offset(&self, t: &AprTensorInfo) -> usize {
        // Both are within the storage for an entry of this file, so this cannot overflow.
        self.header.data_offset.saturating_add(t.offset) as usize
    }

    /// Tensor `t`'s bytes. `t` should come from this file; for an entry that does not fit
    /// it, the answer is an empty slice rather than a panic.
    pub fn tensor_bytes(&self, t: &AprTensorInfo) -> &[u8] {
        let start = self.tensor_offset(t);
        start
            .checked_add(t.size as usize)
            .and_then(|end| self.storage.get(start..end))
            .unwrap_or(&[])
    }

    /// The bytes every tensor borrows from: the memory map (or the caller's storage) for an
    /// uncompressed file, the reconstructed `header ‖ decompressed` bytes for a compressed one.
    pub fn storage(&self) -> &Arc<dyn Storage> {
        &self.storage
    }
}

fn check_regular(path: &Path, meta: &std::fs::Metadata) -> Result<(), AprError> {
    let ft = meta.file_type();
    if ft.is_file() {
        return Ok(());
    }
    let kind = if ft.is_dir() {
        "a directory"
    } else if ft.is_symlink() {
        "a symbolic link"
    } else {
        file_kind(&ft)
    };
    Err(AprError::NotRegularFile {
        path: path.to_path_buf(),
        kind,
    })
}

#[cfg(unix)]
fn file_kind(ft: &std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if ft.is_fifo() {
        "a FIFO"
    } else if ft.is_socket() {
        "a socket"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_block_device() {
        "a block device"
    } else {
        "not a regular file"
    }
}

#[cfg(not(unix))]
fn file_kind(_: &std::fs::FileType) -> &'static str {
    "not a regular file"
}

/// Magic, version, header CRC, flags, in that order.
fn read_header(bytes: &[u8]) -> Result<AprHeader, AprError> {
    let have = bytes.len() as u64;
    if bytes.len() >= 4 && !super::is_apr(bytes) {
        return Err(AprError::BadMagic([bytes[0], bytes[1], bytes[2], bytes[3]]));
    }
    let Some(head) = bytes.first_chunk::<HEADER_SIZE>() else {
        return Err(AprError::Truncated {
            what: "header",
            need: HEADER_SIZE as u64,
            have,
        });
    };
    let header = AprHeader::parse(head);
    debug_assert!(header.magic == MAGIC || header.magic == MAGIC_LEGACY);
    if header.version.0 != 2 {
        return Err(AprError::UnsupportedVersion {
            major: header.version.0,
            minor: header.version.1,
        });
    }
    let found = header_crc(head);
    if found != header.checksum {
        return Err(AprError::HeaderCrc {
            expected: header.checksum,
            found,
        });
    }
    check_flags(header.flags)?;
    Ok(header)
}

fn check_flags(f: u16) -> Result<(), AprError> {
    let refuse = |flag, why: &str| {
        Err(AprError::Refused {
            flag,
            why: why.to_string(),
        })
    };
    if f & flags::ENCRYPTED != 0 {
        return refuse(
            "ENCRYPTED",
            "the payload is encrypted and kiln has no decryption support or keys",
        );
    }
    if f & flags::SIGNED != 0 {
        return refuse(
            "SIGNED",
            "the file carries a signature and kiln has no verification-key support; it refuses \
             signed files rather than load them unverified",
        );
    }
    if f & flags::SHARDED != 0 {
        return refuse(
            "SHARDED",
            "this is one shard of a multi-file model; kiln reads single-file models only",
        );
    }
    if f & flags::COLUMN_MAJOR != 0 {
        return refuse(
            "COLUMN_MAJOR",
            "column-major tensors come from a GGUF import that was not transposed (aprender's \
             LAYOUT-002 rejects them too); re-convert the model",
        );
    }
    if f & flags::LZ4 != 0 && f & flags::ZSTD != 0 {
        return refuse(
            "LZ4|ZSTD",
            "both compression flags are set; a file has one codec at most",
        );
    }
    if f & !flags::KNOWN != 0 {
        return Err(AprError::Refused {
            flag: "unknown",
            why: format!("flag bits {:#06x} have no known meaning", f & !flags::KNOWN),
        });
    }
    Ok(())
}

/// Which codec the payload actually uses. A compression flag over a payload that does not
/// start with that codec's frame magic is an uncompressed file (aprender's writer sets the
/// LZ4 flag without compressing); it is then validated like any uncompressed file.
fn detect_compression(bytes: &[u8], f: u16) -> Compression {
    let magic = bytes.get(HEADER_SIZE..HEADER_SIZE + 4);
    if f & flags::ZSTD != 0 && magic == Some(&ZSTD_MAGIC[..]) {
        Compression::Zstd
    } else if f & flags::LZ4 != 0 && magic == Some(&LZ4_FRAME_MAGIC[..]) {
        Compression::Lz4
    } else {
        Compression::None
    }
}

/// A growable byte buffer whose start is 64-byte aligned, so decompressed tensors are as
/// aligned as mapped ones.
pub(crate) struct AlignedBytes {
    lines: Vec<Line>,
    len: usize,
}

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

impl AlignedBytes {
    fn new() -> Self {
        AlignedBytes {
            lines: Vec::new(),
            len: 0,
        }
    }

    fn capacity(&self) -> usize {
        self.lines.len() * 64
    }

    /// Makes at least `bytes` bytes writable, failing (not aborting) if memory runs out.
    fn grow_to(&mut self, bytes: usize) -> Result<(), AprError> {
        let lines = bytes.div_ceil(64);
        if lines > self.lines.len() {
            self.lines
                .try_reserve_exact(lines - self.lines.len())
                .map_err(|_| AprError::OutOfMemory {
                    bytes: bytes as u64,
                })?;
            self.lines.resize(lines, Line([0; 64]));
        }
        Ok(())
    }

    fn spare(&mut self, end: usize) -> &mut [u8] {
        let cap = self.capacity();
        // SAFETY: `lines` is a contiguous run of `cap` initialised bytes with no padding
        // (`Line` is a 64-byte array aligned to 64).
        let all =
            unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<u8>(), cap) };
        &mut all[self.len..end.min(cap)]
    }

    fn extend_from_slice(&mut self, s: &[u8]) -> Result<(), AprError> {
        let end = self.len + s.len();
        self.grow_to(end)?;
        self.spare(end).copy_from_slice(s);
        self.len = end;
        Ok(())
    }

    /// Reads from `r` until `target` bytes are held or the stream ends, growing (by
    /// doubling, never past `target`) only as real output arrives.
    fn fill(&mut self, r: &mut dyn Read, target: usize) -> Result<(), AprError> {
        while self.len < target {
            if self.len == self.capacity() {
                let want = self.len.saturating_mul(2).max(1 << 20).min(target);
                self.grow_to(want)?;
            }
            let window = self.spare(target);
            match r.read(window) {
                Ok(0) => break,
                Ok(n) => self.len += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(AprError::Decompress(e.to_string())),
            }
        }
        Ok(())
    }
}

impl std::ops::Deref for AlignedBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: as in `spare`; `len <= capacity` always holds.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<u8>(), self.len) }
    }
}

/// Rebuilds `header ‖ decompressed payload`, stopping at the limit.
///
/// Two phases: first the stream is decoded up to `data_offset` (metadata and index), which
/// may not exceed the size-based limit; if the index parses, the whole stream may then be at
/// most `data_offset + align64(end of the last tensor) + 4` bytes, plus 64 KiB of slack,
/// (and never more than the size-based limit). Decoding stops one byte past the limit.
fn decompress(
    raw: &[u8],
    header: &AprHeader,
    codec: Compression,
    opts: &AprReadOptions,
) -> Result<AlignedBytes, AprError> {
    let cap = opts.decompress_limit(raw.len() as u64);
    let cap_usize = usize::try_from(cap).unwrap_or(usize::MAX);
    let payload = &raw[HEADER_SIZE..];
    let mut decoder: Box<dyn Read + '_> = match codec {
        Compression::Lz4 => Box::new(lz4_flex::frame::FrameDecoder::new(payload)),
        Compression::Zstd => Box::new(
            zstd::stream::read::Decoder::with_buffer(payload)
                .map_err(|e| AprError::Decompress(e.to_string()))?,
        ),
        Compression::None => unreachable!("decompress is called for compressed payloads only"),
    };

    let mut out = AlignedBytes::new();
    out.extend_from_slice(&raw[..HEADER_SIZE])?;

    // Phase 1: metadata and index.
    if header.data_offset > cap {
        return Err(AprError::TooLarge {
            what: "metadata and tensor index (data_offset)",
            limit: cap,
        });
    }
    let head_end = header.data_offset as usize;
    out.fill(&mut *decoder, head_end)?;
    let mut limit = cap;
    if out.len == head_end {
        if let Ok(tensors) = parse_index(&out, header) {
            let described = tensors
                .iter()
                .try_fold(0u64, |m, t| t.offset.checked_add(t.size).map(|e| m.max(e)))
                .and_then(align64)
                .and_then(|d| d.checked_add(header.data_offset))
                .and_then(|d| d.checked_add(4 + DECOMPRESS_SLACK));
            if let Some(d) = described {
                limit = limit.min(d);
            }
        }
    }

    // Phase 2: the rest, one byte past the limit at most.
    let limit_usize = usize::try_from(limit).unwrap_or(cap_usize);
    out.fill(&mut *decoder, limit_usize.saturating_add(1))?;
    if out.len > limit_usize {
        return Err(AprError::TooLarge {
            what: "file",
            limit,
        });
    }
    Ok(out)
}

/// Everything after the header: file CRC, section layout, metadata, index, placement.
fn parse_body(
    bytes: &[u8],
    header: &AprHeader,
    verify_crc: bool,
) -> Result<(Map<String, Value>, Vec<AprTensorInfo>), AprError> {
    let len = bytes.len() as u64;
    let min = HEADER_SIZE as u64 + 4;
    if len < min {
        return Err(AprError::Truncated {
            what: "file checksum",
            need: min,
            have: len,
        });
    }
    let payload_end = bytes.len() - 4;
    if verify_crc {
        let tail = &bytes[payload_end..];
        let expected = u32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]);
        let found = crc32fast::hash(&bytes[..payload_end]);
        if expected != found {
            return Err(AprError::FileCrc { expected, found });
        }
    }
    let payload_end = payload_end as u64;

    // Section layout: header < metadata <= index <= data <= payload end.
    let h = header;
    if h.metadata_offset < HEADER_SIZE as u64 {
        return Err(AprError::Layout(format!(
            "metadata_offset {} lies inside the header",
            h.metadata_offset
        )));
    }
    let meta_end = h
        .metadata_offset
        .checked_add(u64::from(h.metadata_size))
        .ok_or_else(|| {
            AprError::Layout(format!(
                "metadata_offset {} + metadata_size overflows",
                h.metadata_offset
            ))
        })?;
    if meta_end > h.tensor_index_offset {
        return Err(AprError::Layout(format!(
            "metadata ({}..{meta_end}) runs past tensor_index_offset {}",
            h.metadata_offset, h.tensor_index_offset
        )));
    }
    if h.tensor_index_offset > h.data_offset {
        return Err(AprError::Layout(format!(
            "tensor_index_offset {} lies after data_offset {}",
            h.tensor_index_offset, h.data_offset
        )));
    }
    if h.data_offset > payload_end {
        return Err(AprError::Layout(format!(
            "data_offset {} lies past the end of the payload ({payload_end} bytes before the checksum)",
            h.data_offset
        )));
    }
    if !h.data_offset.is_multiple_of(ALIGNMENT) {
        return Err(AprError::Layout(format!(
            "data_offset {} is not a multiple of {ALIGNMENT}",
            h.data_offset
        )));
    }

    // Metadata: a JSON object. serde_json checks UTF-8 and bounds its recursion depth.
    let meta = &bytes[h.metadata_offset as usize..meta_end as usize];
    let metadata = match serde_json::from_slice::<Value>(meta) {
        Ok(Value::Object(m)) => m,
        Ok(other) => {
            return Err(AprError::Metadata(format!(
                "expected a JSON object, found {}",
                json_kind(&other)
            )));
        }
        Err(e) => return Err(AprError::Metadata(format!("not valid JSON: {e}"))),
    };

    let tensors = parse_index(bytes, header)?;
    check_placement(&tensors, payload_end - h.data_offset)?;
    Ok((metadata, tensors))
}

/// "a string", "an object", …: a JSON value's kind for messages.
pub fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Parses the `tensor_count` entries of `[tensor_index_offset, data_offset)` and checks
/// each on its own: name, dtype, dims, size, alignment, and strict name order. Needs only
/// the bytes up to `data_offset`.
fn parse_index(bytes: &[u8], h: &AprHeader) -> Result<Vec<AprTensorInfo>, AprError> {
    let start = h.tensor_index_offset;
    let end = h.data_offset;
    if start > end || end > bytes.len() as u64 {
        return Err(AprError::Layout(format!(
            "tensor index region {start}..{end} does not fit in {} bytes",
            bytes.len()
        )));
    }
    let region = &bytes[start as usize..end as usize];
    let count = u64::from(h.tensor_count);
    let fit = region.len() as u64 / MIN_ENTRY;
    if count > fit {
        return Err(AprError::Index(format!(
            "tensor_count {count} cannot fit in the {} bytes of the index region (at most {fit} entries)",
            region.len()
        )));
    }
    let mut cur = Cursor {
        buf: region,
        pos: 0,
        base: start,
    };
    let mut tensors: Vec<AprTensorInfo> = Vec::with_capacity(count as usize);
    for i in 0..count {
        let t = cur.entry(i)?;
        if let Some(prev) = tensors.last() {
            if prev.name.as_str() >= t.name.as_str() {
                return Err(AprError::Index(format!(
                    "names are not strictly sorted: '{}' follows '{}'",
                    t.name, prev.name
                )));
            }
        }
        tensors.push(t);
    }
    let rest = &region[cur.pos..];
    if let Some(p) = rest.iter().position(|&b| b != 0) {
        return Err(AprError::Index(format!(
            "non-zero byte at {} after the last of {count} entries: the index holds more than \
             tensor_count entries, or its padding is not zero",
            start + (cur.pos + p) as u64
        )));
    }
    Ok(tensors)
}

/// Every tensor inside the data section (`data_len` bytes), and no two overlapping.
fn check_placement(tensors: &[AprTensorInfo], data_len: u64) -> Result<(), AprError> {
    for t in tensors {
        let end = t.offset.checked_add(t.size);
        if end.is_none_or(|e| e > data_len) {
            return Err(AprError::Index(format!(
                "tensor '{}': bytes {}..{}+{} lie outside the {data_len}-byte data section",
                t.name, t.offset, t.offset, t.size
            )));
        }
    }
    let mut by_offset: Vec<&AprTensorInfo> = tensors.iter().filter(|t| t.size > 0).collect();
    by_offset.sort_by_key(|t| t.offset);
    for w in by_offset.windows(2) {
        let (a, b) = (w[0], w[1]);
        if a.offset + a.size > b.offset {
            return Err(AprError::Index(format!(
                "tensors '{}' ({}..{}) and '{}' ({}..{}) overlap",
                a.name,
                a.offset,
                a.offset + a.size,
                b.name,
                b.offset,
                b.offset + b.size
            )));
        }
    }
    Ok(())
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    /// Absolute offset of `buf[0]`, for messages.
    base: u64,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str, i: u64) -> Result<&'a [u8], AprError> {
        let buf: &'a [u8] = self.buf;
        match self
            .pos
            .checked_add(n)
            .and_then(|end| buf.get(self.pos..end))
        {
            Some(s) => {
                self.pos += n;
                Ok(s)
            }
            None => Err(AprError::Index(format!(
                "entry {i}: {what} at byte {} runs past data_offset",
                self.base + self.pos as u64
            ))),
        }
    }

    fn u64(&mut self, what: &str, i: u64) -> Result<u64, AprError> {
        let s = self.take(8, what, i)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        Ok(u64::from_le_bytes(a))
    }

    fn entry(&mut self, i: u64) -> Result<AprTensorInfo, AprError> {
        let l = self.take(2, "name_len", i)?;
        let name_len = usize::from(u16::from_le_bytes([l[0], l[1]]));
        if name_len == 0 || name_len > MAX_NAME_LEN {
            return Err(AprError::Index(format!(
                "entry {i}: name_len {name_len} is outside 1..={MAX_NAME_LEN}"
            )));
        }
        let at = self.base + self.pos as u64;
        let raw = self.take(name_len, "name", i)?;
        let name = std::str::from_utf8(raw)
            .map_err(|_| {
                AprError::Index(format!("entry {i}: name at byte {at} is not valid UTF-8"))
            })?
            .to_string();
        let head = self.take(2, "dtype and ndim", i)?;
        let (id, ndim) = (head[0], usize::from(head[1]));
        let dtype = AprDtype::from_id(id)
            .ok_or_else(|| AprError::Index(format!("tensor '{name}': unknown dtype id {id}")))?;
        if ndim > MAX_DIMS {
            return Err(AprError::Index(format!(
                "tensor '{name}': {ndim} dims; at most {MAX_DIMS}"
            )));
        }
        let mut dims = Vec::with_capacity(ndim);
        for _ in 0..ndim {
            dims.push(self.u64("dims", i)?);
        }
        let offset = self.u64("offset", i)?;
        let size = self.u64("size", i)?;
        let elements = dims
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| {
                AprError::Index(format!("tensor '{name}': dims {dims:?} overflow u64"))
            })?;
        let expected = dtype.byte_size(elements).ok_or_else(|| {
            AprError::Index(format!(
                "tensor '{name}': {elements} values of {dtype} have no valid size (not a whole number \
                 of blocks, or it overflows)"
            ))
        })?;
        if size != expected {
            return Err(AprError::Index(format!(
                "tensor '{name}': size {size} but {elements} values of {dtype} take {expected} bytes"
            )));
        }
        if !offset.is_multiple_of(ALIGNMENT) {
            return Err(AprError::Index(format!(
                "tensor '{name}': offset {offset} is not a multiple of {ALIGNMENT}"
            )));
        }
        Ok(AprTensorInfo {
            name,
            dtype,
            dims,
            offset,
            size,
        })
    }
}
