//! The streaming APR v2 writer.

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{Map, Value};

use super::{
    align64, flags, header_crc, AprDtype, AprError, AprHeader, Compression, HEADER_SIZE, MAGIC,
    MAX_DIMS, MAX_NAME_LEN, VERSION,
};

/// One tensor to write: its bytes come from the callback given to [`write_apr`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AprTensorSpec {
    pub name: String,
    pub dtype: AprDtype,
    /// Row-major: the last dimension is contiguous.
    pub dims: Vec<u64>,
}

/// Metadata key whose presence sets the HAS_VOCAB flag.
const VOCAB_KEY: &str = "tokenizer.vocabulary";
const ZEROS: [u8; 64] = [0; 64];

/// Streams an APR v2 file to `path`: header, metadata, the index sorted by name, then each
/// tensor's bytes as `write_tensor(name, out)` writes them, called once per tensor in index
/// order (sorted by name), so memory stays bounded by what the callback holds. What each
/// call writes must be exactly `dtype.byte_size(product of dims)` bytes. Both CRCs are
/// computed while streaming. The file is written under a temporary name in the same
/// directory, synced, and renamed over `path`, so `path` never holds a partial file.
///
/// Flags: ROW_MAJOR always; LZ4 or ZSTD per `compression` (everything after the header is
/// then one frame, with a content checksum); QUANTIZED when any tensor's dtype is quantized;
/// HAS_VOCAB when the metadata has `tokenizer.vocabulary`.
pub fn write_apr(
    path: &Path,
    metadata: &Map<String, Value>,
    tensors: &[AprTensorSpec],
    compression: Compression,
    write_tensor: &mut dyn FnMut(&str, &mut dyn Write) -> io::Result<()>,
) -> Result<(), AprError> {
    let plan = Plan::new(metadata, tensors, compression)?;
    let tmp = temp_path(path)?;
    let file = File::options().write(true).create_new(true).open(&tmp)?;
    let result = plan.write(file, tensors, write_tensor).and_then(|file| {
        file.sync_all()?;
        drop(file);
        std::fs::rename(&tmp, path)?;
        Ok(())
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
        return result;
    }
    // Make the rename durable where the platform allows it; failure here loses nothing.
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        let _ = File::open(dir).and_then(|d| d.sync_all());
    }
    Ok(())
}

fn temp_path(path: &Path) -> Result<PathBuf, AprError> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let name = path
        .file_name()
        .ok_or_else(|| AprError::InvalidSpec(format!("{} has no file name", path.display())))?;
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let tmp = format!(".{}.tmp-{}-{n}", name.to_string_lossy(), std::process::id());
    Ok(path.with_file_name(tmp))
}

/// Everything known before the first byte is written.
struct Plan {
    header: [u8; HEADER_SIZE],
    metadata: Vec<u8>,
    index: Vec<u8>,
    /// Tensor positions in name order, with their sizes.
    order: Vec<(usize, u64)>,
    /// Bytes after the header, trailing CRC included (what the compressor is fed).
    body_len: u64,
    compression: Compression,
}

impl Plan {
    fn new(
        metadata: &Map<String, Value>,
        tensors: &[AprTensorSpec],
        compression: Compression,
    ) -> Result<Plan, AprError> {
        let bad = |msg: String| AprError::InvalidSpec(msg);
        let mut order: Vec<usize> = (0..tensors.len()).collect();
        order.sort_by(|&a, &b| tensors[a].name.cmp(&tensors[b].name));
        for w in order.windows(2) {
            if tensors[w[0]].name == tensors[w[1]].name {
                return Err(bad(format!(
                    "tensor '{}' appears twice",
                    tensors[w[0]].name
                )));
            }
        }
        let count = u32::try_from(tensors.len())
            .map_err(|_| bad(format!("{} tensors; at most 2^32-1", tensors.len())))?;

        let metadata_bytes =
            serde_json::to_vec(metadata).map_err(|e| AprError::Metadata(e.to_string()))?;
        let metadata_size = u32::try_from(metadata_bytes.len()).map_err(|_| {
            AprError::Metadata(format!(
                "{} bytes of JSON; at most 4 GiB",
                metadata_bytes.len()
            ))
        })?;

        let mut index = Vec::new();
        let mut sized = Vec::with_capacity(tensors.len());
        let mut data_len = 0u64;
        let mut quantized = false;
        for &i in &order {
            let t = &tensors[i];
            if t.name.is_empty() || t.name.len() > MAX_NAME_LEN {
                return Err(bad(format!(
                    "tensor name '{}' must be 1..={MAX_NAME_LEN} bytes",
                    t.name
                )));
            }
            if t.dims.len() > MAX_DIMS {
                return Err(bad(format!(
                    "tensor '{}': {} dims; at most {MAX_DIMS}",
                    t.name,
                    t.dims.len()
                )));
            }
            if !t.dtype.is_storable() {
                return Err(bad(format!(
                    "tensor '{}': {} cannot be stored in APR (no APR dtype id names it)",
                    t.name, t.dtype
                )));
            }
            let elements = t
                .dims
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .ok_or_else(|| {
                    bad(format!(
                        "tensor '{}': dims {:?} overflow u64",
                        t.name, t.dims
                    ))
                })?;
            let size = t.dtype.byte_size(elements).ok_or_else(|| {
                bad(format!(
                    "tensor '{}': {elements} values of {} have no valid size",
                    t.name, t.dtype
                ))
            })?;
            quantized |= t.dtype.is_quantized();
            index.extend_from_slice(&(t.name.len() as u16).to_le_bytes());
            index.extend_from_slice(t.name.as_bytes());
            index.push(t.dtype.id());
            index.push(t.dims.len() as u8);
            for d in &t.dims {
                index.extend_from_slice(&d.to_le_bytes());
            }
            index.extend_from_slice(&data_len.to_le_bytes());
            index.extend_from_slice(&size.to_le_bytes());
            sized.push((i, size));
            data_len = data_len
                .checked_add(size)
                .and_then(align64)
                .ok_or_else(|| bad("the tensors' total size overflows u64".into()))?;
        }

        let overflow = || bad("file size overflows u64".into());
        let metadata_offset = HEADER_SIZE as u64;
        let index_offset = align64(u64::from(metadata_size))
            .and_then(|m| m.checked_add(metadata_offset))
            .ok_or_else(overflow)?;
        let data_offset = align64(index.len() as u64)
            .and_then(|i| i.checked_add(index_offset))
            .ok_or_else(overflow)?;
        let body_len = data_offset
            .checked_add(data_len)
            .and_then(|e| e.checked_add(4))
            .ok_or_else(overflow)?
            - HEADER_SIZE as u64;

        let mut f = flags::ROW_MAJOR;
        f |= match compression {
            Compression::None => 0,
            Compression::Lz4 => flags::LZ4,
            Compression::Zstd => flags::ZSTD,
        };
        if quantized {
            f |= flags::QUANTIZED;
        }
        if metadata.contains_key(VOCAB_KEY) {
            f |= flags::HAS_VOCAB;
        }
        let mut header = AprHeader {
            magic: MAGIC,
            version: VERSION,
            flags: f,
            tensor_count: count,
            metadata_offset,
            metadata_size,
            tensor_index_offset: index_offset,
            data_offset,
            checksum: 0,
            reserved: [0; 20],
        };
        header.checksum = header_crc(&header.to_bytes());
        Ok(Plan {
            header: header.to_bytes(),
            metadata: metadata_bytes,
            index,
            order: sized,
            body_len,
            compression,
        })
    }

    fn write(
        &self,
        file: File,
        tensors: &[AprTensorSpec],
        write_tensor: &mut dyn FnMut(&str, &mut dyn Write) -> io::Result<()>,
    ) -> Result<File, AprError> {
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(&self.header)?;
        let sink = match self.compression {
            Compression::None => Sink::Plain(out),
            Compression::Lz4 => {
                let info = lz4_flex::frame::FrameInfo::new()
                    .block_size(lz4_flex::frame::BlockSize::Max4MB)
                    .content_checksum(true)
                    .content_size(Some(self.body_len));
                Sink::Lz4(lz4_flex::frame::FrameEncoder::with_frame_info(info, out))
            }
            Compression::Zstd => {
                let mut enc = zstd::stream::write::Encoder::new(out, 3)?;
                enc.include_checksum(true)?;
                enc.set_pledged_src_size(Some(self.body_len))?;
                Sink::Zstd(enc)
            }
        };
        let mut crc = crc32fast::Hasher::new();
        crc.update(&self.header);
        let mut body = Body { sink, crc };

        body.write_padded(&self.metadata)?;
        body.write_padded(&self.index)?;
        for &(i, size) in &self.order {
            let name = tensors[i].name.as_str();
            let mut w = Limited {
                body: &mut body,
                remaining: size,
                written: 0,
                excess: 0,
            };
            let result = write_tensor(name, &mut w);
            let (written, excess) = (w.written, w.excess);
            if excess > 0 || (result.is_ok() && written != size) {
                return Err(AprError::TensorData {
                    name: name.to_string(),
                    expected: size,
                    written: written + excess,
                });
            }
            result?;
            body.pad(size)?;
        }
        let sum = body.crc.clone().finalize();
        body.sink.write_all(&sum.to_le_bytes())?;
        let out = body.sink.finish()?;
        Ok(out.into_inner().map_err(|e| e.into_error())?)
    }
}

enum Sink {
    Plain(BufWriter<File>),
    Lz4(lz4_flex::frame::FrameEncoder<BufWriter<File>>),
    Zstd(zstd::stream::write::Encoder<'static, BufWriter<File>>),
}

impl Sink {
    fn finish(self) -> io::Result<BufWriter<File>> {
        match self {
            Sink::Plain(w) => Ok(w),
            Sink::Lz4(e) => e.finish().map_err(io::Error::other),
            Sink::Zstd(e) => e.finish(),
        }
    }
}

impl Write for Sink {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Sink::Plain(w) => w.write(buf),
            Sink::Lz4(w) => w.write(buf),
            Sink::Zstd(w) => w.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self {
            Sink::Plain(w) => w.flush(),
            Sink::Lz4(w) => w.flush(),
            Sink::Zstd(w) => w.flush(),
        }
    }
}

/// The body stream: bytes go to the (compressing) sink and into the file CRC.
struct Body {
    sink: Sink,
    crc: crc32fast::Hasher,
}

impl Body {
    fn put(&mut self, buf: &[u8]) -> io::Result<()> {
        self.sink.write_all(buf)?;
        self.crc.update(buf);
        Ok(())
    }

    /// Zero bytes from `len` up to the next multiple of 64.
    fn pad(&mut self, len: u64) -> io::Result<()> {
        let pad = (64 - len % 64) % 64;
        self.put(&ZEROS[..pad as usize])
    }

    fn write_padded(&mut self, buf: &[u8]) -> io::Result<()> {
        self.put(buf)?;
        self.pad(buf.len() as u64)
    }
}

/// What the callback writes into: refuses bytes past the tensor's size.
struct Limited<'a> {
    body: &'a mut Body,
    remaining: u64,
    written: u64,
    excess: u64,
}

impl Write for Limited<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if buf.len() as u64 > self.remaining {
            self.excess = self.excess.saturating_add(buf.len() as u64);
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "more bytes than the tensor's dtype and dims hold",
            ));
        }
        self.body.put(buf)?;
        self.remaining -= buf.len() as u64;
        self.written += buf.len() as u64;
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
