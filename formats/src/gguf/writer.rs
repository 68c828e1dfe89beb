//! Writing GGUF v3.
//!
//! The header holds every tensor's offset, so the tensor table must be known before any
//! data is written, but the data itself need not be in memory: declare tensors with
//! [`GgufWriter::declare_tensor`], call [`GgufWriter::begin`] to write the header, then
//! feed each tensor's bytes in declaration order to [`GgufStreamWriter::write_tensor_data`]
//! (whole or in chunks). Tensors added with their bytes ([`GgufWriter::add_tensor`]) are
//! written automatically when their turn comes, so a fully in-memory file is just
//! [`GgufWriter::write_to`].

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use kiln_core::QType;

use super::{
    GgufArray, GgufError, GgufValue, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_ARRAY_DEPTH,
    MAX_DIMS,
};

struct PendingTensor {
    name: String,
    qtype: QType,
    dims: Vec<usize>,
    n_bytes: u64,
    /// Bytes supplied up front, or `None` when they will be streamed.
    data: Option<Vec<u8>>,
}

/// Collects metadata and the tensor table of a GGUF file to write.
#[derive(Default)]
pub struct GgufWriter {
    metadata: Vec<(String, GgufValue)>,
    keys: HashSet<String>,
    tensors: Vec<PendingTensor>,
    names: HashSet<String>,
    alignment: Option<u64>,
}

impl GgufWriter {
    pub fn new() -> Self {
        GgufWriter::default()
    }

    /// Adds a metadata entry (written in insertion order). `general.alignment` must be a
    /// power of two stored as an unsigned integer; it sets the data alignment.
    pub fn add_kv(
        &mut self,
        key: impl Into<String>,
        value: impl Into<GgufValue>,
    ) -> Result<&mut Self, GgufError> {
        let key = key.into();
        let value = value.into();
        if self.keys.contains(&key) {
            return Err(GgufError::DuplicateKey(key));
        }
        if key == ALIGNMENT_KEY {
            let a = match value {
                GgufValue::U8(_) | GgufValue::U16(_) | GgufValue::U32(_) | GgufValue::U64(_) => {
                    value.as_u64()
                }
                _ => None,
            }
            .ok_or_else(|| GgufError::WrongType {
                key: key.clone(),
                expected: "unsigned integer",
                found: value.value_type(),
            })?;
            if !a.is_power_of_two() {
                return Err(GgufError::BadAlignment(a));
            }
            self.alignment = Some(a);
        }
        if let GgufValue::Array(a) = &value {
            check_depth(&key, a, 1)?;
        }
        self.keys.insert(key.clone());
        self.metadata.push((key, value));
        Ok(self)
    }

    /// Adds a tensor whose bytes are in hand.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        qtype: QType,
        dims: Vec<usize>,
        data: Vec<u8>,
    ) -> Result<&mut Self, GgufError> {
        let name = name.into();
        let n_bytes = checked_size(&name, qtype, &dims)?;
        if data.len() as u64 != n_bytes {
            return Err(GgufError::DataSizeMismatch {
                name,
                expected: n_bytes,
                actual: data.len() as u64,
            });
        }
        self.push_tensor(name, qtype, dims, n_bytes, Some(data))
    }

    /// Declares a tensor whose bytes will be supplied through [`GgufStreamWriter`].
    pub fn declare_tensor(
        &mut self,
        name: impl Into<String>,
        qtype: QType,
        dims: Vec<usize>,
    ) -> Result<&mut Self, GgufError> {
        let name = name.into();
        let n_bytes = checked_size(&name, qtype, &dims)?;
        self.push_tensor(name, qtype, dims, n_bytes, None)
    }

    fn push_tensor(
        &mut self,
        name: String,
        qtype: QType,
        dims: Vec<usize>,
        n_bytes: u64,
        data: Option<Vec<u8>>,
    ) -> Result<&mut Self, GgufError> {
        if !self.names.insert(name.clone()) {
            return Err(GgufError::DuplicateTensor(name));
        }
        self.tensors.push(PendingTensor {
            name,
            qtype,
            dims,
            n_bytes,
            data,
        });
        Ok(self)
    }

    /// Data alignment: `general.alignment` if set, else 32.
    pub fn alignment(&self) -> u64 {
        self.alignment.unwrap_or(DEFAULT_ALIGNMENT)
    }

    /// Bytes the finished file will have.
    pub fn file_len(&self) -> u64 {
        let header = self.header_len();
        let data: u64 = self
            .tensors
            .iter()
            .map(|t| t.n_bytes.next_multiple_of(self.alignment()))
            .sum();
        header.next_multiple_of(self.alignment()) + data
    }

    fn header_len(&self) -> u64 {
        let mut n = 4 + 4 + 8 + 8;
        for (k, v) in &self.metadata {
            n += 8 + k.len() as u64 + 4 + value_len(v);
        }
        for t in &self.tensors {
            n += 8 + t.name.len() as u64 + 4 + 8 * t.dims.len() as u64 + 4 + 8;
        }
        n
    }

    /// Writes the header and tensor table, and returns the writer that takes the data.
    pub fn begin<W: Write>(self, w: W) -> Result<GgufStreamWriter<W>, GgufError> {
        let alignment = self.alignment();
        let mut out = Counting {
            inner: w,
            written: 0,
        };
        out.write_all(&GGUF_MAGIC)?;
        out.write_all(&3u32.to_le_bytes())?;
        out.write_all(&(self.tensors.len() as u64).to_le_bytes())?;
        out.write_all(&(self.metadata.len() as u64).to_le_bytes())?;
        for (k, v) in &self.metadata {
            write_str(&mut out, k)?;
            out.write_all(&v.value_type().id().to_le_bytes())?;
            write_value(&mut out, v)?;
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            write_str(&mut out, &t.name)?;
            out.write_all(&(t.dims.len() as u32).to_le_bytes())?;
            for &d in &t.dims {
                out.write_all(&(d as u64).to_le_bytes())?;
            }
            out.write_all(&t.qtype.ggml_id().to_le_bytes())?;
            out.write_all(&offset.to_le_bytes())?;
            offset += t.n_bytes.next_multiple_of(alignment);
        }
        out.pad_to(alignment)?;
        let mut stream = GgufStreamWriter {
            out,
            alignment,
            tensors: self.tensors,
            current: 0,
            written_in_current: 0,
        };
        stream.flush_ready()?;
        Ok(stream)
    }

    /// Writes the whole file; every tensor must have been added with its bytes.
    pub fn write_to<W: Write>(self, w: W) -> Result<W, GgufError> {
        self.begin(w)?.finish()
    }

    /// [`GgufWriter::write_to`] a new file at `path`.
    pub fn write_file(self, path: impl AsRef<Path>) -> Result<(), GgufError> {
        let file = File::create(path)?;
        let mut w = self.write_to(BufWriter::new(file))?;
        w.flush()?;
        w.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        Ok(())
    }
}

/// The data phase of writing: takes each streamed tensor's bytes in declaration order.
pub struct GgufStreamWriter<W: Write> {
    out: Counting<W>,
    alignment: u64,
    tensors: Vec<PendingTensor>,
    /// Index of the tensor whose data comes next.
    current: usize,
    written_in_current: u64,
}

impl<W: Write> GgufStreamWriter<W> {
    /// Name, type and dims of the tensor whose bytes are expected next; `None` when done.
    pub fn next_tensor(&self) -> Option<(&str, QType, &[usize])> {
        self.tensors
            .get(self.current)
            .map(|t| (t.name.as_str(), t.qtype, t.dims.as_slice()))
    }

    /// Appends `chunk` to the current streamed tensor's data. A chunk must not run past the
    /// end of the tensor; when a tensor is complete its padding is written and the writer
    /// moves on (writing any following tensors whose bytes were given up front).
    pub fn write_tensor_data(&mut self, chunk: &[u8]) -> Result<(), GgufError> {
        let Some(t) = self.tensors.get(self.current) else {
            return Err(GgufError::UnexpectedTensorData);
        };
        let total = self.written_in_current + chunk.len() as u64;
        if total > t.n_bytes {
            return Err(GgufError::DataSizeMismatch {
                name: t.name.clone(),
                expected: t.n_bytes,
                actual: total,
            });
        }
        self.out.write_all(chunk)?;
        self.written_in_current = total;
        if total == t.n_bytes {
            self.end_tensor()?;
            self.flush_ready()?;
        }
        Ok(())
    }

    fn end_tensor(&mut self) -> Result<(), GgufError> {
        self.out.pad_to(self.alignment)?;
        self.tensors[self.current].data = None;
        self.current += 1;
        self.written_in_current = 0;
        Ok(())
    }

    /// Writes consecutive tensors whose data is already in memory (and empty tensors).
    fn flush_ready(&mut self) -> Result<(), GgufError> {
        while let Some(t) = self.tensors.get_mut(self.current) {
            if let Some(data) = t.data.take() {
                self.out.write_all(&data)?;
            } else if t.n_bytes != 0 {
                return Ok(());
            }
            self.end_tensor()?;
        }
        Ok(())
    }

    /// Checks every tensor got its data and returns the underlying writer.
    pub fn finish(mut self) -> Result<W, GgufError> {
        if let Some(t) = self.tensors.get(self.current) {
            return Err(GgufError::MissingTensorData {
                name: t.name.clone(),
            });
        }
        self.out.flush()?;
        Ok(self.out.inner)
    }
}

fn checked_size(name: &str, qtype: QType, dims: &[usize]) -> Result<u64, GgufError> {
    if dims.len() > MAX_DIMS {
        return Err(GgufError::TooManyDims {
            name: name.to_string(),
            n_dims: dims.len() as u64,
        });
    }
    qtype
        .tensor_bytes(dims)
        .map(|n| n as u64)
        .map_err(|e| GgufError::BadShape {
            name: name.to_string(),
            reason: e.to_string(),
        })
}

fn check_depth(key: &str, a: &GgufArray, depth: usize) -> Result<(), GgufError> {
    if depth > MAX_ARRAY_DEPTH {
        return Err(GgufError::NestingTooDeep {
            key: key.to_string(),
        });
    }
    if let GgufArray::Array(items) = a {
        for item in items {
            check_depth(key, item, depth + 1)?;
        }
    }
    Ok(())
}

/// Encoded size of a value's payload (without its type id).
fn value_len(v: &GgufValue) -> u64 {
    match v {
        GgufValue::String(s) => 8 + s.len() as u64,
        GgufValue::Array(a) => array_len(a),
        other => other.value_type().min_encoded_len() as u64,
    }
}

fn array_len(a: &GgufArray) -> u64 {
    12 + match a {
        GgufArray::String(v) => v.iter().map(|s| 8 + s.len() as u64).sum(),
        GgufArray::Array(v) => v.iter().map(array_len).sum(),
        other => other.len() as u64 * other.elem_type().min_encoded_len() as u64,
    }
}

fn write_str(w: &mut impl Write, s: &str) -> std::io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

fn write_value(w: &mut impl Write, v: &GgufValue) -> std::io::Result<()> {
    match v {
        GgufValue::U8(x) => w.write_all(&x.to_le_bytes()),
        GgufValue::I8(x) => w.write_all(&x.to_le_bytes()),
        GgufValue::U16(x) => w.write_all(&x.to_le_bytes()),
        GgufValue::I16(x) => w.write_all(&x.to_le_bytes()),
        GgufValue::U32(x) => w.write_all(&x.to_le_bytes()),
        GgufValue::I32(x) => w.write_all(&x.to_le_bytes()),
        GgufValue::F32(x) => w.write_all(&x.to_le_bytes()),
        GgufValue::Bool(x) => w.write_all(&[*x as u8]),
        GgufValue::String(s) => write_str(w, s),
        GgufValue::Array(a) => write_array(w, a),
        GgufValue::U64(x) => w.write_all(&x.to_le_bytes()),
        GgufValue::I64(x) => w.write_all(&x.to_le_bytes()),
        GgufValue::F64(x) => w.write_all(&x.to_le_bytes()),
    }
}

fn write_array(w: &mut impl Write, a: &GgufArray) -> std::io::Result<()> {
    w.write_all(&a.elem_type().id().to_le_bytes())?;
    w.write_all(&(a.len() as u64).to_le_bytes())?;
    fn each<T: Copy, const N: usize>(
        w: &mut impl Write,
        v: &[T],
        enc: fn(T) -> [u8; N],
    ) -> std::io::Result<()> {
        // One write per array rather than per item: a vocabulary has 10^5 entries.
        let mut buf = Vec::with_capacity(v.len() * N);
        for &x in v {
            buf.extend_from_slice(&enc(x));
        }
        w.write_all(&buf)
    }
    match a {
        GgufArray::U8(v) => w.write_all(v),
        GgufArray::I8(v) => each(w, v, i8::to_le_bytes),
        GgufArray::U16(v) => each(w, v, u16::to_le_bytes),
        GgufArray::I16(v) => each(w, v, i16::to_le_bytes),
        GgufArray::U32(v) => each(w, v, u32::to_le_bytes),
        GgufArray::I32(v) => each(w, v, i32::to_le_bytes),
        GgufArray::F32(v) => each(w, v, f32::to_le_bytes),
        GgufArray::Bool(v) => each(w, v, |b: bool| [b as u8]),
        GgufArray::U64(v) => each(w, v, u64::to_le_bytes),
        GgufArray::I64(v) => each(w, v, i64::to_le_bytes),
        GgufArray::F64(v) => each(w, v, f64::to_le_bytes),
        GgufArray::String(v) => v.iter().try_for_each(|s| write_str(w, s)),
        GgufArray::Array(v) => v.iter().try_for_each(|inner| write_array(w, inner)),
    }
}

/// Tracks the byte position so padding can be computed without `Seek`.
struct Counting<W: Write> {
    inner: W,
    written: u64,
}

impl<W: Write> Counting<W> {
    fn pad_to(&mut self, alignment: u64) -> std::io::Result<()> {
        const ZEROS: [u8; 64] = [0; 64];
        let mut pad = self.written.next_multiple_of(alignment) - self.written;
        while pad > 0 {
            let n = pad.min(ZEROS.len() as u64) as usize;
            self.write_all(&ZEROS[..n])?;
            pad -= n as u64;
        }
        Ok(())
    }
}

impl<W: Write> Write for Counting<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.written += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}
