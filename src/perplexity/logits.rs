//! The saved-logits file: a reference model's token distributions over a text, kept so that
//! another model file or backend can be scored against them (KL-divergence) without running
//! the reference again.
//!
//! Layout (little-endian), version 1:
//!
//! | bytes | field |
//! |---|---|
//! | 8 | magic `KILNLOGP` |
//! | 4 | version (1) |
//! | 4 | vocabulary size V |
//! | 4 | context C (tokens a chunk) |
//! | 4 | first scored position F of a chunk (rows are F..C−2, predicting F+1..C−1) |
//! | 4 | chunks N |
//! | 16 | tokenizer fingerprint (SHA-256 of every token's bytes, first 16 bytes) |
//! | 4·N·C | the tokens, as evaluated except each chunk's BOS replacement |
//! | 4 | CRC32 of everything before it |
//!
//! then per chunk `C − 1 − F` rows, each `8 + 2V` bytes: f32 `scale`, f32 `min_log_prob`,
//! V × u16 `q`, read back as `log p = scale·q + min_log_prob`; then the chunk's CRC32.
//!
//! The rows are llama.cpp's trade (its `--kl-divergence-base` files hold the same 16-bit
//! rows): log-probabilities more than 16 nats below a row's best are clamped (a token
//! that improbable adds at most e^-16 per token to a KL sum), the rest land on a grid of at
//! most 16/65535 ≈ 2.4e-4 nats — a KLD error of order 1e-8, far under what separates two
//! quantisations (1e-3 and up), for half the bytes of f32. Unlike llama.cpp's file the
//! header names its version and the tokenizer, and every chunk carries a CRC, so a file from
//! another vocabulary or tokenisation, or a truncated or corrupted one, is refused with a
//! reason instead of being read as numbers. A writer goes to `PATH.partial` and is renamed
//! over `PATH` only when complete: nothing is ever half-written under the name asked for.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use kiln_core::{Error, Result};
use sha2::{Digest, Sha256};

const MAGIC: &[u8; 8] = b"KILNLOGP";
const VERSION: u32 = 1;
/// Log-probabilities this far below a row's best are clamped to it.
pub const CLAMP_NATS: f32 = 16.0;
const HEADER_BYTES: u64 = 8 + 4 * 5 + 16;

/// What a logits file describes: the text's tokens and how they were cut into chunks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogitsHeader {
    pub vocab: usize,
    pub ctx: usize,
    pub first: usize,
    pub chunks: usize,
    pub tokenizer: [u8; 16],
    /// `chunks × ctx` tokens.
    pub tokens: Vec<u32>,
}

impl LogitsHeader {
    /// Rows a chunk holds: positions `first..ctx − 1`.
    pub fn rows_per_chunk(&self) -> usize {
        self.ctx - 1 - self.first
    }

    fn row_bytes(&self) -> u64 {
        8 + 2 * self.vocab as u64
    }

    fn file_bytes(&self) -> u64 {
        let chunk = self.rows_per_chunk() as u64 * self.row_bytes() + 4;
        HEADER_BYTES + 4 * self.tokens.len() as u64 + 4 + self.chunks as u64 * chunk
    }
}

/// The tokenizer's fingerprint: SHA-256 over every token's bytes (each prefixed by its
/// length), first 16 bytes. Two files tokenise a text alike when their fingerprints match.
pub fn tokenizer_fingerprint(tokenizer: &kiln_formats::tokenizer::Tokenizer) -> [u8; 16] {
    let mut h = Sha256::new();
    for id in 0..tokenizer.vocab_size() as u32 {
        let bytes = tokenizer.token_bytes(id).unwrap_or(&[]);
        h.update((bytes.len() as u32).to_le_bytes());
        h.update(bytes);
    }
    let mut out = [0u8; 16];
    out.copy_from_slice(&h.finalize()[..16]);
    out
}

/// One row of log-probabilities quantised to 16 bits (see the module header).
#[derive(Debug, Clone, PartialEq)]
pub struct QuantRow {
    pub scale: f32,
    pub min_log_prob: f32,
    pub q: Vec<u16>,
}

impl QuantRow {
    /// Quantises the log-softmax of `logits`.
    pub fn from_logits(logits: &[f32]) -> QuantRow {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let lowest = logits.iter().copied().fold(f32::INFINITY, f32::min);
        let lo = lowest.max(max - CLAMP_NATS);
        let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
        let lse = sum.ln() as f32;
        let scale = (max - lo) / 65535.0;
        let q = if scale > 0.0 {
            let inv = 1.0 / scale;
            logits
                .iter()
                .map(|&l| {
                    if l > lo {
                        (inv * (l - lo)).round_ties_even().min(65535.0) as u16
                    } else {
                        0
                    }
                })
                .collect()
        } else {
            vec![0; logits.len()]
        };
        QuantRow {
            scale,
            min_log_prob: lo - max - lse,
            q,
        }
    }

    /// The log-probability of token `i`.
    pub fn log_prob(&self, i: usize) -> f32 {
        self.scale * self.q[i] as f32 + self.min_log_prob
    }
}

fn bad(path: &Path, what: impl std::fmt::Display) -> Error {
    Error::SavedLogits {
        path: path.display().to_string(),
        message: what.to_string(),
    }
}

/// Writes a logits file chunk by chunk; [`LogitsWriter::finish`] puts it in place.
pub struct LogitsWriter {
    out: BufWriter<File>,
    partial: PathBuf,
    path: PathBuf,
    header: LogitsHeader,
    crc: crc32fast::Hasher,
    rows_in_chunk: usize,
    chunks_done: usize,
}

impl LogitsWriter {
    /// Starts `path` (written as `path.partial` until [`LogitsWriter::finish`]).
    pub fn create(path: &Path, header: LogitsHeader) -> Result<LogitsWriter> {
        let mut name = path.as_os_str().to_owned();
        name.push(".partial");
        let partial = PathBuf::from(name);
        let file = File::create(&partial).map_err(|e| {
            Error::Io(std::io::Error::new(
                e.kind(),
                format!("{}: {e}", partial.display()),
            ))
        })?;
        let mut w = LogitsWriter {
            out: BufWriter::with_capacity(1 << 20, file),
            partial,
            path: path.to_path_buf(),
            header,
            crc: crc32fast::Hasher::new(),
            rows_in_chunk: 0,
            chunks_done: 0,
        };
        let h = &w.header;
        let mut head = Vec::with_capacity(HEADER_BYTES as usize + 4 * h.tokens.len());
        head.extend_from_slice(MAGIC);
        for v in [
            VERSION,
            h.vocab as u32,
            h.ctx as u32,
            h.first as u32,
            h.chunks as u32,
        ] {
            head.extend_from_slice(&v.to_le_bytes());
        }
        head.extend_from_slice(&h.tokenizer);
        for t in &h.tokens {
            head.extend_from_slice(&t.to_le_bytes());
        }
        let crc = crc32fast::hash(&head);
        head.extend_from_slice(&crc.to_le_bytes());
        w.write(&head)?;
        Ok(w)
    }

    fn write(&mut self, bytes: &[u8]) -> Result<()> {
        let r = self.out.write_all(bytes);
        r.map_err(|e| self.io_error(e))
    }

    fn io_error(&self, e: std::io::Error) -> Error {
        Error::Io(std::io::Error::new(
            e.kind(),
            format!("{}: {e}", self.partial.display()),
        ))
    }

    /// Appends the next row (the logits of one scored position).
    pub fn push_row(&mut self, logits: &[f32]) -> Result<()> {
        self.push_quantized(&QuantRow::from_logits(logits))
    }

    /// Appends the next row, already quantised by [`QuantRow::from_logits`] (which a
    /// scorer runs on its own threads).
    pub fn push_quantized(&mut self, row: &QuantRow) -> Result<()> {
        let mut bytes = Vec::with_capacity(8 + 2 * row.q.len());
        bytes.extend_from_slice(&row.scale.to_le_bytes());
        bytes.extend_from_slice(&row.min_log_prob.to_le_bytes());
        for q in &row.q {
            bytes.extend_from_slice(&q.to_le_bytes());
        }
        self.crc.update(&bytes);
        self.write(&bytes)?;
        self.rows_in_chunk += 1;
        if self.rows_in_chunk == self.header.rows_per_chunk() {
            let crc = std::mem::take(&mut self.crc).finalize();
            self.write(&crc.to_le_bytes())?;
            self.rows_in_chunk = 0;
            self.chunks_done += 1;
        }
        Ok(())
    }

    /// Flushes the file and renames it to the path asked for; refuses a file with chunks
    /// missing (it is removed instead).
    pub fn finish(mut self) -> Result<()> {
        if self.chunks_done != self.header.chunks || self.rows_in_chunk != 0 {
            let _ = std::fs::remove_file(&self.partial);
            return Err(Error::InvalidArgument(format!(
                "{}: {} of {} chunks written; the file is not kept",
                self.path.display(),
                self.chunks_done,
                self.header.chunks
            )));
        }
        let r = self.out.flush().and_then(|_| self.out.get_ref().sync_all());
        r.map_err(|e| self.io_error(e))?;
        std::fs::rename(&self.partial, &self.path).map_err(|e| self.io_error(e))
    }
}

impl Drop for LogitsWriter {
    /// A writer dropped before `finish` (an error midway) leaves nothing behind.
    fn drop(&mut self) {
        // After `finish` the partial file has become `path`: nothing is left to remove.
        let _ = std::fs::remove_file(&self.partial);
    }
}

/// Reads a logits file chunk by chunk, checking each chunk's CRC.
pub struct LogitsReader {
    input: BufReader<File>,
    path: PathBuf,
    pub header: LogitsHeader,
    chunks_read: usize,
}

fn read_u32(r: &mut impl Read) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

impl LogitsReader {
    /// Opens `path` and reads its header; a file that is not a kiln logits file, of another
    /// version, or whose length disagrees with its header is refused before anything is
    /// allocated from its numbers.
    pub fn open(path: &Path) -> Result<LogitsReader> {
        let file = File::open(path).map_err(|e| {
            Error::Io(std::io::Error::new(
                e.kind(),
                format!("{}: {e}", path.display()),
            ))
        })?;
        let len = file
            .metadata()
            .map_err(|e| {
                Error::Io(std::io::Error::new(
                    e.kind(),
                    format!("{}: {e}", path.display()),
                ))
            })?
            .len();
        let mut input = BufReader::with_capacity(1 << 20, file);
        let short = |_| bad(path, "too short for a kiln logits file");
        let mut head = [0u8; HEADER_BYTES as usize];
        input.read_exact(&mut head).map_err(short)?;
        if &head[..8] != MAGIC {
            return Err(bad(path, "not a kiln logits file (no KILNLOGP magic)"));
        }
        let field = |i: usize| u32::from_le_bytes(head[8 + 4 * i..12 + 4 * i].try_into().unwrap());
        let version = field(0);
        if version != VERSION {
            return Err(bad(
                path,
                format!("logits file version {version}; this kiln reads version {VERSION}"),
            ));
        }
        let (vocab, ctx, first, chunks) = (
            field(1) as usize,
            field(2) as usize,
            field(3) as usize,
            field(4) as usize,
        );
        if vocab == 0 || ctx < 2 || first + 1 >= ctx || chunks == 0 {
            return Err(bad(
                path,
                format!("impossible header: vocabulary {vocab}, context {ctx}, first scored {first}, {chunks} chunks"),
            ));
        }
        let mut tokenizer = [0u8; 16];
        tokenizer.copy_from_slice(&head[28..44]);
        let mut header = LogitsHeader {
            vocab,
            ctx,
            first,
            chunks,
            tokenizer,
            tokens: Vec::new(),
        };
        // The header's numbers must describe this file's length exactly before any of them
        // sizes an allocation.
        let n_tokens = (chunks as u64).checked_mul(ctx as u64);
        let expected = n_tokens.and_then(|n| {
            let rows = (ctx - 1 - first) as u64;
            let chunk = rows.checked_mul(8 + 2 * vocab as u64)?.checked_add(4)?;
            HEADER_BYTES
                .checked_add(n_tokens?.checked_mul(4)?)?
                .checked_add(4)?
                .checked_add((chunks as u64).checked_mul(chunk)?)
                .filter(|_| n > 0)
        });
        match expected {
            Some(e) if e == len => {}
            Some(e) => {
                return Err(bad(
                    path,
                    format!(
                    "{len} bytes where its header describes {e}: truncated or not a logits file"
                ),
                ))
            }
            None => return Err(bad(path, "header sizes overflow")),
        }
        let n = n_tokens.unwrap() as usize;
        let mut raw = vec![0u8; 4 * n];
        input.read_exact(&mut raw).map_err(short)?;
        let crc = read_u32(&mut input).map_err(short)?;
        let mut check = crc32fast::Hasher::new();
        check.update(&head);
        check.update(&raw);
        if check.finalize() != crc {
            return Err(bad(
                path,
                "the header's checksum does not match: the file is corrupt",
            ));
        }
        header.tokens = raw
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        if let Some(t) = header.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(bad(
                path,
                format!("token {t} is outside its vocabulary of {vocab}"),
            ));
        }
        debug_assert_eq!(header.file_bytes(), len);
        Ok(LogitsReader {
            input,
            path: path.to_path_buf(),
            header,
            chunks_read: 0,
        })
    }

    /// The next chunk's rows, into `rows` (reused between calls).
    pub fn read_chunk(&mut self, rows: &mut Vec<QuantRow>) -> Result<()> {
        let h = &self.header;
        if self.chunks_read == h.chunks {
            return Err(Error::InvalidArgument(format!(
                "{}: all {} chunks have been read",
                self.path.display(),
                h.chunks
            )));
        }
        let (vocab, n) = (h.vocab, h.rows_per_chunk());
        rows.resize_with(n, || QuantRow {
            scale: 0.0,
            min_log_prob: 0.0,
            q: Vec::new(),
        });
        let mut crc = crc32fast::Hasher::new();
        let mut buf = vec![0u8; 8 + 2 * vocab];
        let path = &self.path;
        let short = |_| bad(path, "ends inside a chunk: truncated");
        for row in rows.iter_mut() {
            self.input.read_exact(&mut buf).map_err(short)?;
            crc.update(&buf);
            row.scale = f32::from_le_bytes(buf[0..4].try_into().unwrap());
            row.min_log_prob = f32::from_le_bytes(buf[4..8].try_into().unwrap());
            row.q.clear();
            row.q.extend(
                buf[8..]
                    .chunks_exact(2)
                    .map(|b| u16::from_le_bytes([b[0], b[1]])),
            );
            if !(row.scale.is_finite() && row.min_log_prob.is_finite() && row.scale >= 0.0) {
                return Err(bad(
                    path,
                    format!(
                        "chunk {}: a row's scale is not a finite number",
                        self.chunks_read + 1
                    ),
                ));
            }
        }
        let want = read_u32(&mut self.input).map_err(short)?;
        if crc.finalize() != want {
            return Err(bad(
                path,
                format!(
                    "chunk {}'s checksum does not match: the file is corrupt",
                    self.chunks_read + 1
                ),
            ));
        }
        self.chunks_read += 1;
        Ok(())
    }
}
