//! GGUF v2/v3: a zero-copy reader over a memory map, and a streaming writer.
//!
//! Layout (little-endian): magic `GGUF`, version `u32`, tensor count `u64`, metadata count
//! `u64`, the metadata (key string, value type `u32`, value), the tensor infos (name,
//! `n_dims u32`, `dims u64 × n_dims`, ggml type `u32`, offset `u64`), padding to
//! `general.alignment` (default 32), then the tensor data. Offsets are relative to the start
//! of the data section; `dims[0]` is the contiguous row length.
//!
//! The reader treats the file as hostile: every count and length is checked against the
//! bytes that remain before anything is allocated, all offset and size arithmetic is
//! checked, and every tensor must lie wholly inside the file, so opening a file costs at
//! most a small multiple of its metadata size in memory and never panics.

mod value;
mod writer;

pub use value::{GgufArray, GgufType, GgufValue};
pub use writer::{GgufStreamWriter, GgufWriter};

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use kiln_core::{QType, Storage, TensorView};

/// `GGUF` as the first four bytes of the file.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Data-section alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// The metadata key that overrides the alignment.
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// ggml tensors have at most four dimensions.
pub const MAX_DIMS: usize = 4;
/// Arrays of arrays deeper than this are refused: real files never nest, and unbounded
/// recursion would let a small file exhaust the stack.
pub const MAX_ARRAY_DEPTH: usize = 8;

/// Everything that can be wrong with a GGUF file (or with what a writer was given).
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("not a GGUF file: magic bytes are {0:02x?}, expected \"GGUF\"")]
    BadMagic([u8; 4]),
    #[error("GGUF version {0} is not supported (only 2 and 3)")]
    UnsupportedVersion(u32),
    #[error("file ends inside {what} at byte {offset}")]
    Truncated { what: &'static str, offset: u64 },
    #[error("{what} count {value} cannot fit in the bytes left in the file")]
    AbsurdCount { what: &'static str, value: u64 },
    #[error("{what} length {value} is larger than the file")]
    AbsurdLength { what: &'static str, value: u64 },
    #[error("metadata '{key}': unknown value type id {id}")]
    UnknownValueType { key: String, id: u32 },
    #[error("metadata '{key}': arrays nested deeper than {MAX_ARRAY_DEPTH}")]
    NestingTooDeep { key: String },
    #[error("tensor '{tensor}': unknown ggml type id {id}")]
    UnknownQType { tensor: String, id: u32 },
    #[error("{what} at byte {offset} is not valid UTF-8")]
    BadUtf8 { what: &'static str, offset: u64 },
    #[error("tensor '{name}' has {n_dims} dimensions; ggml allows at most {MAX_DIMS}")]
    TooManyDims { name: String, n_dims: u64 },
    #[error("tensor '{name}': dims {dims:?} overflow")]
    DimsOverflow { name: String, dims: Vec<u64> },
    #[error("tensor '{name}': {reason}")]
    BadShape { name: String, reason: String },
    #[error(
        "tensor '{name}': data offset {offset} is not a multiple of the alignment {alignment}"
    )]
    MisalignedTensor {
        name: String,
        offset: u64,
        alignment: u64,
    },
    #[error("tensor '{name}': bytes {start}..{start}+{len} lie past the end of the file ({file_len} bytes)")]
    TensorOutOfBounds {
        name: String,
        start: u64,
        len: u64,
        file_len: u64,
    },
    #[error("tensor '{0}' appears twice")]
    DuplicateTensor(String),
    #[error("tensors '{first}' and '{second}' overlap in the data section")]
    OverlappingTensors { first: String, second: String },
    #[error("metadata key '{0}' appears twice")]
    DuplicateKey(String),
    #[error("general.alignment {0} is not a power of two")]
    BadAlignment(u64),
    #[error("metadata '{key}' has type {found}, expected {expected}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: GgufType,
    },
    #[error("tensor '{name}': given {actual} bytes of data, its type and dims need {expected}")]
    DataSizeMismatch {
        name: String,
        expected: u64,
        actual: u64,
    },
    #[error("tensor '{name}' was declared but not all of its data was supplied")]
    MissingTensorData { name: String },
    #[error("more tensor data supplied than the declared tensors hold")]
    UnexpectedTensorData,
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
}

impl From<GgufError> for kiln_core::Error {
    fn from(e: GgufError) -> Self {
        match e {
            GgufError::Io(io) => kiln_core::Error::Io(io),
            other => kiln_core::Error::Format(format!("GGUF: {other}")),
        }
    }
}

/// One tensor's entry in the file's tensor table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the contiguous row length.
    pub dims: Vec<usize>,
    pub qtype: QType,
    /// Offset of the data from the start of the data section.
    pub offset: u64,
    /// Bytes of data (from the type and dims).
    pub n_bytes: usize,
}

impl GgufTensorInfo {
    pub fn elements(&self) -> usize {
        self.dims.iter().product()
    }
}

/// An opened GGUF file: parsed metadata and tensor table, plus the shared bytes that tensor
/// views borrow from.
pub struct GgufFile {
    storage: Arc<dyn Storage>,
    version: u32,
    metadata: Vec<(String, GgufValue)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u64,
    data_offset: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .field("bytes", &self.storage.len())
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps and parses `path`. Tensor data is not read until a view's bytes are.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        let file = File::open(path.as_ref())?;
        let len = file.metadata()?.len();
        if len == 0 {
            // An empty mapping is refused by some platforms; the answer is the same anyway.
            return Err(GgufError::Truncated {
                what: "magic",
                offset: 0,
            });
        }
        // SAFETY: the map is read-only. Another process truncating or rewriting the file
        // while it is mapped is outside what any mmap-based reader can defend against;
        // llama.cpp and candle accept the same contract.
        let map = unsafe { memmap2::Mmap::map(&file)? };
        GgufFile::from_storage(Arc::new(map))
    }

    /// Parses GGUF bytes already in memory (or mapped by the caller).
    pub fn from_storage(storage: Arc<dyn Storage>) -> Result<GgufFile, GgufError> {
        let parsed = parse(&storage)?;
        Ok(GgufFile {
            storage,
            version: parsed.version,
            key_index: index_of(&parsed.metadata, |(k, _)| k).map_err(GgufError::DuplicateKey)?,
            metadata: parsed.metadata,
            tensor_index: index_of(&parsed.tensors, |t| &t.name)
                .map_err(GgufError::DuplicateTensor)?,
            tensors: parsed.tensors,
            alignment: parsed.alignment,
            data_offset: parsed.data_offset,
        })
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    /// Every metadata entry, in file order.
    pub fn metadata(&self) -> &[(String, GgufValue)] {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.key_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// An integer of any width, if present, non-negative and an integer.
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key)?.as_u64()
    }

    pub fn get_usize(&self, key: &str) -> Option<usize> {
        self.get(key)?.as_usize()
    }

    pub fn get_i64(&self, key: &str) -> Option<i64> {
        self.get(key)?.as_i64()
    }

    /// A float (or integer) as `f32`.
    pub fn get_f32(&self, key: &str) -> Option<f32> {
        self.get(key)?.as_f32()
    }

    pub fn get_bool(&self, key: &str) -> Option<bool> {
        self.get(key)?.as_bool()
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key)?.as_str()
    }

    pub fn get_array(&self, key: &str) -> Option<&GgufArray> {
        self.get(key)?.as_array()
    }

    pub fn get_string_array(&self, key: &str) -> Option<&[String]> {
        self.get(key)?.as_string_array()
    }

    pub fn get_f32_array(&self, key: &str) -> Option<&[f32]> {
        self.get(key)?.as_f32_array()
    }

    pub fn get_i32_array(&self, key: &str) -> Option<&[i32]> {
        self.get(key)?.as_i32_array()
    }

    /// Key `key` read by `get` (one of the `as_*` accessors), strictly: `None` when the key
    /// is absent, `WrongType` when it is present with a type `get` does not accept — a
    /// value of the wrong type is never taken for a missing one.
    pub fn typed<'a, T>(
        &'a self,
        key: &str,
        expected: &'static str,
        get: impl Fn(&'a GgufValue) -> Option<T>,
    ) -> Result<Option<T>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => get(v).map(Some).ok_or_else(|| GgufError::WrongType {
                key: key.to_string(),
                expected,
                found: v.value_type(),
            }),
        }
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Option<&str> {
        self.get_str("general.architecture")
    }

    /// The tensor table, in file order.
    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// Position of the tensor named `name` in [`GgufFile::tensors`].
    pub fn tensor_index(&self, name: &str) -> Option<usize> {
        self.tensor_index.get(name).copied()
    }

    /// A zero-copy view of a tensor's data, sharing this file's storage.
    pub fn view(&self, info: &GgufTensorInfo) -> kiln_core::Result<TensorView> {
        let start = self
            .data_offset
            .checked_add(info.offset)
            .and_then(|s| usize::try_from(s).ok())
            .ok_or_else(|| {
                kiln_core::Error::Format(format!("tensor {}: offset overflows", info.name))
            })?;
        TensorView::new(
            info.name.as_str(),
            info.qtype,
            info.dims.clone(),
            self.storage.clone(),
            start,
        )
    }

    /// [`GgufFile::view`] by name.
    pub fn view_by_name(&self, name: &str) -> kiln_core::Result<Option<TensorView>> {
        self.tensor(name).map(|t| self.view(t)).transpose()
    }

    /// Alignment of the data section and of every tensor in it.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Byte offset of the data section within the file.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Total bytes of the file.
    pub fn file_len(&self) -> u64 {
        self.storage.len() as u64
    }

    /// The bytes every view borrows from.
    pub fn storage(&self) -> &Arc<dyn Storage> {
        &self.storage
    }
}

fn index_of<T>(items: &[T], key: impl Fn(&T) -> &String) -> Result<HashMap<String, usize>, String> {
    let mut map = HashMap::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        if map.insert(key(item).clone(), i).is_some() {
            return Err(key(item).clone());
        }
    }
    Ok(map)
}

struct Parsed {
    version: u32,
    metadata: Vec<(String, GgufValue)>,
    tensors: Vec<GgufTensorInfo>,
    alignment: u64,
    data_offset: u64,
}

/// The smallest encoding of one metadata entry: empty key (8) + type (4) + a 1-byte value.
const MIN_KV_LEN: usize = 8 + 4 + 1;
/// The smallest encoding of one tensor info: empty name (8) + n_dims (4) + type (4) + offset (8).
const MIN_TENSOR_INFO_LEN: usize = 8 + 4 + 4 + 8;

fn parse(bytes: &[u8]) -> Result<Parsed, GgufError> {
    let mut r = Reader { buf: bytes, pos: 0 };
    let magic: [u8; 4] = r.array("magic")?;
    if magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic(magic));
    }
    let version = r.u32("version")?;
    // Version 1 used 32-bit counts and lengths; a big-endian file reads as a huge number.
    if version != 2 && version != 3 {
        return Err(GgufError::UnsupportedVersion(version));
    }
    let n_tensors = r.u64("tensor count")?;
    let n_kv = r.u64("metadata count")?;
    let n_kv = r.count(n_kv, MIN_KV_LEN, "metadata")?;
    // Every tensor info follows the metadata, so the two together must fit.
    let n_tensors = r.count(n_tensors, MIN_TENSOR_INFO_LEN, "tensor")?;

    let mut metadata = Vec::with_capacity(n_kv);
    for _ in 0..n_kv {
        let key = r.string("metadata key")?;
        let type_id = r.u32("metadata value type")?;
        let ty = GgufType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType {
            key: key.clone(),
            id: type_id,
        })?;
        let value = r.value(ty, &key)?;
        metadata.push((key, value));
    }

    let alignment = match metadata.iter().find(|(k, _)| k == ALIGNMENT_KEY) {
        None => DEFAULT_ALIGNMENT,
        Some((_, v)) => {
            let a = v.as_u64().ok_or_else(|| GgufError::WrongType {
                key: ALIGNMENT_KEY.into(),
                expected: "unsigned integer",
                found: v.value_type(),
            })?;
            if !a.is_power_of_two() {
                return Err(GgufError::BadAlignment(a));
            }
            a
        }
    };

    let mut tensors = Vec::with_capacity(n_tensors);
    for _ in 0..n_tensors {
        tensors.push(r.tensor_info(alignment)?);
    }

    let file_len = bytes.len() as u64;
    let data_offset = (r.pos as u64)
        .checked_next_multiple_of(alignment)
        .ok_or(GgufError::BadAlignment(alignment))?;
    for t in &tensors {
        let out = || GgufError::TensorOutOfBounds {
            name: t.name.clone(),
            start: data_offset.saturating_add(t.offset),
            len: t.n_bytes as u64,
            file_len,
        };
        let start = data_offset.checked_add(t.offset).ok_or_else(out)?;
        let end = start.checked_add(t.n_bytes as u64).ok_or_else(out)?;
        if end > file_len {
            return Err(out());
        }
    }
    // No two tensors may share bytes: a tensor written through one name would change
    // another, and a file that aliases its tensors is not one a converter writes.
    let mut ranges: Vec<(u64, u64, usize)> = tensors
        .iter()
        .enumerate()
        .filter(|(_, t)| t.n_bytes > 0)
        .map(|(i, t)| (t.offset, t.offset + t.n_bytes as u64, i))
        .collect();
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(GgufError::OverlappingTensors {
                first: tensors[w[0].2].name.clone(),
                second: tensors[w[1].2].name.clone(),
            });
        }
    }
    Ok(Parsed {
        version,
        metadata,
        tensors,
        alignment,
        data_offset,
    })
}

/// A bounds-checked little-endian cursor over the file.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                what,
                offset: self.pos as u64,
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], GgufError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, GgufError> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, GgufError> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// Checks that `n` items of at least `min_len` bytes each can fit in what is left:
    /// a count that could not fit even in the whole file is absurd, one that only overruns
    /// the end is a truncation.
    fn count(&self, n: u64, min_len: usize, what: &'static str) -> Result<usize, GgufError> {
        let need = n.checked_mul(min_len as u64);
        match need {
            Some(need) if need <= self.remaining() as u64 => Ok(n as usize),
            Some(need) if need <= self.buf.len() as u64 => Err(GgufError::Truncated {
                what,
                offset: self.pos as u64,
            }),
            _ => Err(GgufError::AbsurdCount { what, value: n }),
        }
    }

    fn string(&mut self, what: &'static str) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        if len > self.buf.len() as u64 {
            return Err(GgufError::AbsurdLength { what, value: len });
        }
        let offset = self.pos as u64;
        let bytes = self.take(len as usize, what)?;
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|_| GgufError::BadUtf8 { what, offset })
    }

    fn value(&mut self, ty: GgufType, key: &str) -> Result<GgufValue, GgufError> {
        const W: &str = "metadata value";
        Ok(match ty {
            GgufType::U8 => GgufValue::U8(self.array::<1>(W)?[0]),
            GgufType::I8 => GgufValue::I8(self.array::<1>(W)?[0] as i8),
            GgufType::U16 => GgufValue::U16(u16::from_le_bytes(self.array(W)?)),
            GgufType::I16 => GgufValue::I16(i16::from_le_bytes(self.array(W)?)),
            GgufType::U32 => GgufValue::U32(u32::from_le_bytes(self.array(W)?)),
            GgufType::I32 => GgufValue::I32(i32::from_le_bytes(self.array(W)?)),
            GgufType::F32 => GgufValue::F32(f32::from_le_bytes(self.array(W)?)),
            GgufType::Bool => GgufValue::Bool(self.array::<1>(W)?[0] != 0),
            GgufType::String => GgufValue::String(self.string("metadata string")?),
            GgufType::Array => GgufValue::Array(self.array_value(key, 1)?),
            GgufType::U64 => GgufValue::U64(u64::from_le_bytes(self.array(W)?)),
            GgufType::I64 => GgufValue::I64(i64::from_le_bytes(self.array(W)?)),
            GgufType::F64 => GgufValue::F64(f64::from_le_bytes(self.array(W)?)),
        })
    }

    /// An array payload: element type, count, items. `depth` counts enclosing arrays.
    fn array_value(&mut self, key: &str, depth: usize) -> Result<GgufArray, GgufError> {
        if depth > MAX_ARRAY_DEPTH {
            return Err(GgufError::NestingTooDeep {
                key: key.to_string(),
            });
        }
        let type_id = self.u32("array element type")?;
        let ty = GgufType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType {
            key: key.to_string(),
            id: type_id,
        })?;
        let n = self.u64("array length")?;
        let n = self.count(n, ty.min_encoded_len(), "array element")?;
        const W: &str = "array data";
        Ok(match ty {
            GgufType::U8 => GgufArray::U8(self.take(n, W)?.to_vec()),
            GgufType::I8 => GgufArray::I8(self.take(n, W)?.iter().map(|&b| b as i8).collect()),
            GgufType::Bool => GgufArray::Bool(self.take(n, W)?.iter().map(|&b| b != 0).collect()),
            GgufType::U16 => GgufArray::U16(self.fixed(n, u16::from_le_bytes)?),
            GgufType::I16 => GgufArray::I16(self.fixed(n, i16::from_le_bytes)?),
            GgufType::U32 => GgufArray::U32(self.fixed(n, u32::from_le_bytes)?),
            GgufType::I32 => GgufArray::I32(self.fixed(n, i32::from_le_bytes)?),
            GgufType::F32 => GgufArray::F32(self.fixed(n, f32::from_le_bytes)?),
            GgufType::U64 => GgufArray::U64(self.fixed(n, u64::from_le_bytes)?),
            GgufType::I64 => GgufArray::I64(self.fixed(n, i64::from_le_bytes)?),
            GgufType::F64 => GgufArray::F64(self.fixed(n, f64::from_le_bytes)?),
            GgufType::String => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.string("array string")?);
                }
                GgufArray::String(v)
            }
            GgufType::Array => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.array_value(key, depth + 1)?);
                }
                GgufArray::Array(v)
            }
        })
    }

    /// `n` fixed-size little-endian items (`n` already bounded by [`Reader::count`]).
    fn fixed<T, const N: usize>(
        &mut self,
        n: usize,
        decode: fn([u8; N]) -> T,
    ) -> Result<Vec<T>, GgufError> {
        let bytes = self.take(n * N, "array data")?;
        Ok(bytes
            .chunks_exact(N)
            .map(|c| {
                let mut a = [0u8; N];
                a.copy_from_slice(c);
                decode(a)
            })
            .collect())
    }

    fn tensor_info(&mut self, alignment: u64) -> Result<GgufTensorInfo, GgufError> {
        let name = self.string("tensor name")?;
        let n_dims = self.u32("tensor dim count")? as u64;
        if n_dims as usize > MAX_DIMS {
            return Err(GgufError::TooManyDims { name, n_dims });
        }
        let mut raw = [0u64; MAX_DIMS];
        for d in raw.iter_mut().take(n_dims as usize) {
            *d = self.u64("tensor dims")?;
        }
        let raw = &raw[..n_dims as usize];
        let type_id = self.u32("tensor type")?;
        let offset = self.u64("tensor offset")?;
        let qtype = QType::from_ggml_id(type_id).ok_or_else(|| GgufError::UnknownQType {
            tensor: name.clone(),
            id: type_id,
        })?;

        let overflow = || GgufError::DimsOverflow {
            name: name.clone(),
            dims: raw.to_vec(),
        };
        let dims: Vec<usize> = raw
            .iter()
            .map(|&d| usize::try_from(d))
            .collect::<Result<_, _>>()
            .map_err(|_| overflow())?;
        // ggml counts elements in an int64.
        let elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
            .ok_or_else(overflow)?;
        if elements > i64::MAX as u64 {
            return Err(overflow());
        }
        let row_len = dims.first().copied().unwrap_or(1);
        if row_len % qtype.block_len() != 0 {
            let reason = format!(
                "row length {row_len} is not a whole number of {qtype} blocks ({} values)",
                qtype.block_len()
            );
            return Err(GgufError::BadShape { name, reason });
        }
        let n_bytes = (elements / qtype.block_len() as u64)
            .checked_mul(qtype.block_bytes() as u64)
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(overflow)?;
        if offset % alignment != 0 {
            return Err(GgufError::MisalignedTensor {
                name,
                offset,
                alignment,
            });
        }
        Ok(GgufTensorInfo {
            name,
            dims,
            qtype,
            offset,
            n_bytes,
        })
    }
}
