//! APR v2 container: round trips for every dtype and codec, CRC-valid hostile indexes, a
//! deterministic corruption suite, decompression bombs with measured peak allocation, the
//! fuzz seed corpus under a stable harness, and the independent Python checker.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kiln_core::QType;
use kiln_formats::apr::{
    flags, header_crc, is_apr, write_apr, AprDtype, AprError, AprFile, AprHeader, AprReadOptions,
    AprTensorSpec, Compression, MAGIC,
};
use serde_json::{json, Map, Value};

// ---------------------------------------------------------------------------------------
// Per-thread allocation accounting (tests run in parallel threads, so a global counter
// would mix them up). Const-initialised `Cell`s need no allocation and no destructor.

struct Counting;
thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn track(delta: isize) {
    let _ = LIVE.try_with(|live| {
        let now = live.get() + delta;
        live.set(now);
        let _ = PEAK.try_with(|p| p.set(p.get().max(now)));
    });
}

// SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            track(layout.size() as isize);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            track(layout.size() as isize);
        }
        p
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            track(new_size as isize - layout.size() as isize);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
        unsafe { System.dealloc(ptr, layout) };
        track(-(layout.size() as isize));
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Runs `f` and returns its result with the most heap bytes it held at once (this thread's
/// Rust allocations; the C zstd library's own buffers are not counted).
fn peak_heap<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let start = LIVE.with(|l| l.get());
    PEAK.with(|p| p.set(start));
    let out = f();
    let peak = PEAK.with(|p| p.get());
    (out, (peak - start).max(0) as usize)
}

// ---------------------------------------------------------------------------------------
// Helpers.

/// xorshift64*: deterministic and dependency-free.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

struct TempDir(PathBuf);
impl TempDir {
    fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("kiln-apr-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn spec(name: &str, dtype: AprDtype, dims: &[u64]) -> AprTensorSpec {
    AprTensorSpec {
        name: name.to_string(),
        dtype,
        dims: dims.to_vec(),
    }
}

/// Deterministic, name-dependent bytes of the right length for `s`.
fn data_for(s: &AprTensorSpec) -> Vec<u8> {
    let n: u64 = s.dims.iter().product();
    let size = s.dtype.byte_size(n).unwrap() as usize;
    let seed = s.name.bytes().fold(0x9E37_79B9_7F4A_7C15u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01B3)
    });
    let mut rng = Rng(seed | 1);
    (0..size).map(|_| rng.next() as u8).collect()
}

/// One tensor of every dtype (names deliberately not in sorted order), plus a scalar and
/// an empty tensor.
fn every_dtype() -> Vec<AprTensorSpec> {
    let mut v = Vec::new();
    for (i, d) in AprDtype::ALL.iter().copied().enumerate().rev() {
        let dims: Vec<u64> = match d {
            AprDtype::Ggml(q) if q.block_len() == 256 => vec![2, 256],
            AprDtype::Ggml(q) if q.block_len() == 32 => vec![3, 64],
            AprDtype::Q4 => vec![5, 7], // 35 values: a partial last block
            _ => vec![2, 3, 5],
        };
        v.push(spec(&format!("t{i:02}.{}", d.name()), d, &dims));
    }
    v.push(spec("z.scalar", AprDtype::Ggml(QType::F32), &[]));
    v.push(spec("a.empty", AprDtype::Q8, &[0, 16]));
    v.push(spec("a.empty_f16", AprDtype::Ggml(QType::F16), &[4, 0]));
    v
}

fn sample_metadata() -> Map<String, Value> {
    let v = json!({
        "model_type": "llama",
        "architecture": "llama",
        "hidden_size": 64,
        "rope_theta": 10000.0,
        "tokenizer.vocabulary": ["<s>", "</s>", "a", "b", "ab", "ünï"],
        "nested": {"a": [1, 2, {"b": null}]},
    });
    v.as_object().unwrap().clone()
}

fn write_file(path: &Path, meta: &Map<String, Value>, specs: &[AprTensorSpec], c: Compression) {
    let by_name: std::collections::HashMap<String, Vec<u8>> = specs
        .iter()
        .map(|s| (s.name.clone(), data_for(s)))
        .collect();
    write_apr(path, meta, specs, c, &mut |name, out| {
        // Write in uneven pieces to exercise the streaming path.
        let bytes = &by_name[name];
        for chunk in bytes.chunks(7) {
            out.write_all(chunk)?;
        }
        Ok(())
    })
    .unwrap();
}

fn write_bytes(meta: &Map<String, Value>, specs: &[AprTensorSpec], c: Compression) -> Vec<u8> {
    let dir = TempDir::new(&format!("wb-{}", rand_tag()));
    let p = dir.path("f.apr");
    write_file(&p, meta, specs, c);
    std::fs::read(&p).unwrap()
}

fn rand_tag() -> usize {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// Recomputes the header CRC and (for an uncompressed payload) the trailing CRC.
fn fix_crcs(b: &mut [u8]) {
    if b.len() >= 64 {
        let mut h = [0u8; 64];
        h.copy_from_slice(&b[..64]);
        let c = header_crc(&h);
        b[40..44].copy_from_slice(&c.to_le_bytes());
    }
    // A compressed payload (frame magic after the header) carries its CRC inside the frame.
    let compressed = matches!(
        b.get(64..68),
        Some([0x28, 0xB5, 0x2F, 0xFD]) | Some([0x04, 0x22, 0x4D, 0x18])
    );
    if b.len() >= 68 && !compressed {
        let n = b.len() - 4;
        let c = crc32fast::hash(&b[..n]);
        b[n..].copy_from_slice(&c.to_le_bytes());
    }
}

fn fix_header_crc(b: &mut [u8]) {
    let mut h = [0u8; 64];
    h.copy_from_slice(&b[..64]);
    let c = header_crc(&h);
    b[40..44].copy_from_slice(&c.to_le_bytes());
}

/// What a parsed file means: metadata, index and every tensor's bytes.
type Meaning = (
    Map<String, Value>,
    Vec<(String, AprDtype, Vec<u64>, Vec<u8>)>,
);

fn meaning(f: &AprFile) -> Meaning {
    let t = f
        .tensors()
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                t.dtype,
                t.dims.clone(),
                f.tensor_bytes(t).to_vec(),
            )
        })
        .collect();
    (f.metadata().clone(), t)
}

/// Invariants any accepted file must satisfy.
fn check_invariants(f: &AprFile) {
    let n = f.storage().len();
    let mut prev: Option<&str> = None;
    for t in f.tensors() {
        if let Some(p) = prev {
            assert!(p < t.name.as_str());
        }
        prev = Some(&t.name);
        let off = f.tensor_offset(t);
        assert!(off + t.size as usize <= n);
        assert_eq!(f.tensor_bytes(t).len() as u64, t.size);
        assert_eq!(t.dtype.byte_size(t.elements()), Some(t.size));
        assert_eq!(t.offset % 64, 0);
        assert_eq!(f.tensor(&t.name).map(|x| &x.name), Some(&t.name));
    }
}

// ---------------------------------------------------------------------------------------
// Round trips.

#[test]
fn round_trip_every_dtype_and_codec() {
    let dir = TempDir::new("rt");
    let specs = every_dtype();
    let meta = sample_metadata();
    for c in [Compression::None, Compression::Lz4, Compression::Zstd] {
        let p = dir.path(&format!("m-{c:?}.apr"));
        write_file(&p, &meta, &specs, c);
        let raw = std::fs::read(&p).unwrap();
        assert!(is_apr(&raw));
        assert_eq!(&raw[..4], &MAGIC);
        for f in [
            AprFile::open(&p).unwrap(),
            AprFile::from_bytes(raw.clone()).unwrap(),
        ] {
            assert_eq!(f.version(), (2, 0));
            assert_eq!(f.compression(), c);
            let fl = f.flags();
            assert_ne!(fl & flags::ROW_MAJOR, 0);
            assert_ne!(fl & flags::QUANTIZED, 0);
            assert_ne!(fl & flags::HAS_VOCAB, 0);
            assert_eq!(fl & flags::LZ4 != 0, c == Compression::Lz4);
            assert_eq!(fl & flags::ZSTD != 0, c == Compression::Zstd);
            assert_eq!(f.metadata(), &meta);
            assert_eq!(f.tensors().len(), specs.len());
            let names: Vec<&str> = f.tensors().iter().map(|t| t.name.as_str()).collect();
            let mut sorted = names.clone();
            sorted.sort();
            assert_eq!(names, sorted, "index is sorted by name");
            for s in &specs {
                let t = f
                    .tensor(&s.name)
                    .unwrap_or_else(|| panic!("{} missing", s.name));
                assert_eq!(t.dtype, s.dtype);
                assert_eq!(t.dims, s.dims);
                assert_eq!(
                    f.tensor_bytes(t),
                    &data_for(s)[..],
                    "{} bytes ({c:?})",
                    s.name
                );
                assert_eq!(f.tensor_offset(t), (f.data_offset() + t.offset) as usize);
                assert_eq!(
                    &f.storage()[f.tensor_offset(t)..][..t.size as usize],
                    f.tensor_bytes(t)
                );
                // Decompressed storage starts 64-byte aligned (mapped storage is checked below).
                if t.size > 0 && c != Compression::None {
                    assert_eq!(
                        f.tensor_bytes(t).as_ptr() as usize % 64,
                        0,
                        "{} aligned in memory",
                        s.name
                    );
                }
            }
            check_invariants(&f);
        }
        // The memory-mapped uncompressed file is aligned too.
        if c == Compression::None {
            let f = AprFile::open(&p).unwrap();
            for t in f.tensors().iter().filter(|t| t.size > 0) {
                assert_eq!(f.tensor_bytes(t).as_ptr() as usize % 64, 0);
            }
        }
    }
    assert!(AprFile::open(dir.path("m-None.apr"))
        .unwrap()
        .tensor("nope")
        .is_none());
}

#[test]
fn uncompressed_layout_matches_the_spec() {
    let specs = vec![
        spec("b", AprDtype::Ggml(QType::F32), &[3]),
        spec("a", AprDtype::Q8, &[10]),
    ];
    let mut meta = Map::new();
    meta.insert("k".into(), json!("v"));
    let b = write_bytes(&meta, &specs, Compression::None);
    let h = AprHeader::parse(b[..64].try_into().unwrap());
    assert_eq!(&b[0..4], b"APR\0");
    assert_eq!((b[4], b[5]), (2, 0));
    assert_eq!(h.flags, flags::ROW_MAJOR | flags::QUANTIZED);
    assert_eq!(h.tensor_count, 2);
    assert_eq!(h.metadata_offset, 64);
    assert_eq!(h.metadata_size as usize, br#"{"k":"v"}"#.len());
    assert_eq!(&b[64..64 + h.metadata_size as usize], br#"{"k":"v"}"#);
    assert_eq!(h.tensor_index_offset, 128);
    assert_eq!(h.reserved, [0; 20]);
    assert_eq!(h.checksum, header_crc(b[..64].try_into().unwrap()));
    // Header CRC is over bytes 0..40 and 44..64.
    let mut hb = b[..64].to_vec();
    hb[40..44].fill(0);
    let mut hh = crc32fast::Hasher::new();
    hh.update(&hb[..40]);
    hh.update(&hb[44..]);
    assert_eq!(hh.finalize(), h.checksum);
    // Index: "a" (Q8, id 129) first, then "b" (F32, id 0).
    let i = h.tensor_index_offset as usize;
    assert_eq!(&b[i..i + 3], &[1, 0, b'a']);
    assert_eq!(b[i + 3], 129);
    assert_eq!(b[i + 4], 1);
    assert_eq!(u64::from_le_bytes(b[i + 5..i + 13].try_into().unwrap()), 10);
    assert_eq!(u64::from_le_bytes(b[i + 13..i + 21].try_into().unwrap()), 0); // offset
    assert_eq!(
        u64::from_le_bytes(b[i + 21..i + 29].try_into().unwrap()),
        14
    ); // 4 + 10
    let j = i + 29;
    assert_eq!(&b[j..j + 3], &[1, 0, b'b']);
    assert_eq!(
        u64::from_le_bytes(b[j + 13..j + 21].try_into().unwrap()),
        64
    ); // aligned offset
    assert_eq!(h.data_offset, 192);
    // Two tensors, each padded to 64, then the CRC.
    assert_eq!(b.len(), 192 + 128 + 4);
    let n = b.len() - 4;
    assert_eq!(
        u32::from_le_bytes(b[n..].try_into().unwrap()),
        crc32fast::hash(&b[..n])
    );
}

#[test]
fn compression_shrinks_compressible_data() {
    let specs = vec![spec("w", AprDtype::Ggml(QType::F32), &[64, 1024])];
    let meta = Map::new();
    let dir = TempDir::new("shrink");
    let mut sizes = Vec::new();
    for c in [Compression::None, Compression::Lz4, Compression::Zstd] {
        let p = dir.path(&format!("{c:?}.apr"));
        write_apr(&p, &meta, &specs, c, &mut |_, out| {
            out.write_all(&vec![0u8; 64 * 1024 * 4])
        })
        .unwrap();
        let f = AprFile::open(&p).unwrap();
        assert!(f.tensor_bytes(&f.tensors()[0]).iter().all(|&x| x == 0));
        sizes.push(std::fs::metadata(&p).unwrap().len());
    }
    assert!(
        sizes[1] < sizes[0] / 20 && sizes[2] < sizes[0] / 20,
        "{sizes:?}"
    );
}

#[test]
fn aprender_flag_only_lz4_and_legacy_magic_are_read() {
    let specs = vec![spec("w", AprDtype::Ggml(QType::F16), &[8])];
    let meta = sample_metadata();
    let plain = write_bytes(&meta, &specs, Compression::None);
    let want = meaning(&AprFile::from_bytes(plain.clone()).unwrap());

    // aprender's `with_lz4_compression` sets the flag over an uncompressed payload.
    let mut b = plain.clone();
    b[6] |= flags::LZ4 as u8;
    fix_crcs(&mut b);
    let f = AprFile::from_bytes(b).unwrap();
    assert_eq!(f.compression(), Compression::None);
    assert_eq!(meaning(&f), want);

    let mut b = plain.clone();
    b[..4].copy_from_slice(b"APR2");
    fix_crcs(&mut b);
    assert!(is_apr(&b));
    assert_eq!(meaning(&AprFile::from_bytes(b).unwrap()), want);

    // Minor versions are accepted; nonzero reserved bytes are tolerated (covered by the CRC).
    let mut b = plain.clone();
    b[5] = 7;
    b[50] = 0xAA;
    fix_crcs(&mut b);
    assert_eq!(AprFile::from_bytes(b).unwrap().version(), (2, 7));
}

// ---------------------------------------------------------------------------------------
// Header-level refusals.

fn small_plain() -> Vec<u8> {
    let specs = vec![
        spec("layer.0.w", AprDtype::Ggml(QType::Q8_0), &[2, 32]),
        spec("layer.0.b", AprDtype::Ggml(QType::F32), &[5]),
        spec("tok", AprDtype::Q4, &[40]),
    ];
    let mut meta = Map::new();
    meta.insert("architecture".into(), json!("llama"));
    write_bytes(&meta, &specs, Compression::None)
}

#[test]
fn header_refusals_are_typed() {
    let base = small_plain();
    let with = |f: &dyn Fn(&mut Vec<u8>)| {
        let mut b = base.clone();
        f(&mut b);
        fix_crcs(&mut b);
        AprFile::from_bytes(b)
    };
    for (bit, name) in [
        (flags::ENCRYPTED, "ENCRYPTED"),
        (flags::SIGNED, "SIGNED"),
        (flags::SHARDED, "SHARDED"),
        (flags::COLUMN_MAJOR, "COLUMN_MAJOR"),
        (flags::LZ4 | flags::ZSTD, "LZ4|ZSTD"),
        (0x1000, "unknown"),
    ] {
        let r = with(&|b| {
            let f = u16::from_le_bytes([b[6], b[7]]) | bit;
            b[6..8].copy_from_slice(&f.to_le_bytes());
        });
        match r {
            Err(AprError::Refused { flag, why }) => {
                assert_eq!(flag, name);
                assert!(!why.is_empty());
            }
            other => panic!("{name}: {other:?}"),
        }
    }
    let e = with(&|b| b[6..8].copy_from_slice(&(flags::SIGNED).to_le_bytes())).unwrap_err();
    assert!(e.to_string().contains("verification-key"), "{e}");
    assert!(matches!(
        kiln_core::Error::from(e),
        kiln_core::Error::Unsupported(_)
    ));

    assert!(matches!(
        with(&|b| b[4] = 3),
        Err(AprError::UnsupportedVersion { major: 3, minor: 0 })
    ));
    assert!(matches!(
        with(&|b| b[4] = 1),
        Err(AprError::UnsupportedVersion { major: 1, .. })
    ));
    assert!(matches!(with(&|b| b[3] = b'N'), Err(AprError::BadMagic(_))));
    assert!(matches!(
        AprFile::from_bytes(b"GGUF".to_vec()),
        Err(AprError::BadMagic(_))
    ));
    assert!(matches!(
        AprFile::from_bytes(b"AP".to_vec()),
        Err(AprError::Truncated { what: "header", .. })
    ));
    assert!(matches!(
        AprFile::from_bytes(base[..63].to_vec()),
        Err(AprError::Truncated { what: "header", .. })
    ));
    let mut b = base[..66].to_vec();
    fix_crcs(&mut b);
    assert!(matches!(
        AprFile::from_bytes(b),
        Err(AprError::Truncated {
            what: "file checksum",
            ..
        })
    ));
}

#[test]
fn crc_failures_say_which_crc() {
    let base = small_plain();
    let mut b = base.clone();
    b[10] ^= 1; // tensor_count: inside the header CRC
    assert!(matches!(
        AprFile::from_bytes(b),
        Err(AprError::HeaderCrc { .. })
    ));
    let mut b = base.clone();
    b[41] ^= 0x80; // the stored header CRC itself
    assert!(matches!(
        AprFile::from_bytes(b),
        Err(AprError::HeaderCrc { .. })
    ));
    let mut b = base.clone();
    let n = b.len();
    b[n - 70] ^= 4; // tensor data
    let e = AprFile::from_bytes(b).unwrap_err();
    assert!(matches!(e, AprError::FileCrc { .. }), "{e}");
    assert!(e.to_string().contains("file CRC32"));
    let mut b = base.clone();
    b[n - 1] ^= 4; // the trailing CRC
    assert!(matches!(
        AprFile::from_bytes(b),
        Err(AprError::FileCrc { .. })
    ));

    // With CRC checking off, the same data corruption is read as data.
    let mut b = base.clone();
    b[n - 70] ^= 4;
    let opts = AprReadOptions {
        verify_file_crc: false,
        ..AprReadOptions::default()
    };
    assert!(AprFile::from_bytes_with(b, &opts).is_ok());
}

// ---------------------------------------------------------------------------------------
// CRC-valid hostile files, built by hand.

struct Entry {
    name: Vec<u8>,
    name_len: Option<u16>,
    dtype: u8,
    ndim: Option<u8>,
    dims: Vec<u64>,
    offset: u64,
    size: u64,
}

fn entry(name: &str, dtype: AprDtype, dims: &[u64], offset: u64) -> Entry {
    let n: u64 = dims.iter().product();
    Entry {
        name: name.as_bytes().to_vec(),
        name_len: None,
        dtype: dtype.id(),
        ndim: None,
        dims: dims.to_vec(),
        offset,
        size: dtype.byte_size(n).unwrap(),
    }
}

type HeaderTweak = Box<dyn Fn(&mut AprHeader)>;

struct Craft {
    meta: Vec<u8>,
    entries: Vec<Entry>,
    count: Option<u32>,
    data_len: usize,
    index_pad: Vec<u8>,
    tweak: Option<HeaderTweak>,
}

impl Craft {
    fn new(entries: Vec<Entry>, data_len: usize) -> Craft {
        Craft {
            meta: b"{}".to_vec(),
            entries,
            count: None,
            data_len,
            index_pad: Vec::new(),
            tweak: None,
        }
    }

    fn build(&self) -> Vec<u8> {
        let mut index = Vec::new();
        for e in &self.entries {
            index.extend_from_slice(&e.name_len.unwrap_or(e.name.len() as u16).to_le_bytes());
            index.extend_from_slice(&e.name);
            index.push(e.dtype);
            index.push(e.ndim.unwrap_or(e.dims.len() as u8));
            for d in &e.dims {
                index.extend_from_slice(&d.to_le_bytes());
            }
            index.extend_from_slice(&e.offset.to_le_bytes());
            index.extend_from_slice(&e.size.to_le_bytes());
        }
        index.extend_from_slice(&self.index_pad);
        let a = |n: usize| n.div_ceil(64) * 64;
        let meta_off = 64usize;
        let index_off = meta_off + a(self.meta.len());
        let data_off = index_off + a(index.len());
        let mut h = AprHeader {
            magic: MAGIC,
            version: (2, 0),
            flags: flags::ROW_MAJOR,
            tensor_count: self.count.unwrap_or(self.entries.len() as u32),
            metadata_offset: meta_off as u64,
            metadata_size: self.meta.len() as u32,
            tensor_index_offset: index_off as u64,
            data_offset: data_off as u64,
            checksum: 0,
            reserved: [0; 20],
        };
        if let Some(t) = &self.tweak {
            t(&mut h);
        }
        let mut b = h.to_bytes().to_vec();
        b.extend_from_slice(&self.meta);
        b.resize(index_off, 0);
        b.extend_from_slice(&index);
        b.resize(data_off, 0);
        b.extend((0..self.data_len).map(|i| i as u8));
        b.extend_from_slice(&[0; 4]);
        fix_crcs(&mut b);
        b
    }
}

fn f32s() -> AprDtype {
    AprDtype::Ggml(QType::F32)
}

fn expect_index_err(c: &Craft, needle: &str) {
    match AprFile::from_bytes(c.build()) {
        Err(AprError::Index(msg)) => assert!(msg.contains(needle), "'{msg}' lacks '{needle}'"),
        other => panic!("expected an index error containing '{needle}', got {other:?}"),
    }
}

#[test]
fn crafted_baseline_is_valid() {
    let c = Craft::new(
        vec![
            entry("a", f32s(), &[16], 0),
            entry("b", f32s(), &[4, 4], 64),
        ],
        128,
    );
    let f = AprFile::from_bytes(c.build()).unwrap();
    assert_eq!(f.tensors().len(), 2);
    check_invariants(&f);
}

#[test]
fn hostile_index_entries_are_refused() {
    // Overlap: b starts inside a.
    expect_index_err(
        &Craft::new(
            vec![entry("a", f32s(), &[32], 0), entry("b", f32s(), &[4], 64)],
            256,
        ),
        "overlap",
    );
    // Overlap by aliasing the same bytes.
    expect_index_err(
        &Craft::new(
            vec![entry("a", f32s(), &[4], 0), entry("b", f32s(), &[4], 0)],
            64,
        ),
        "overlap",
    );
    // Out of range.
    expect_index_err(
        &Craft::new(vec![entry("a", f32s(), &[32], 64)], 128),
        "outside",
    );
    expect_index_err(
        &Craft::new(vec![entry("a", f32s(), &[4], u64::MAX - 63)], 64),
        "outside",
    );
    // Dims whose product overflows u64 (size set to something plausible).
    let mut e = entry("a", f32s(), &[4], 0);
    e.dims = vec![u64::MAX / 2, 3];
    expect_index_err(&Craft::new(vec![e], 64), "overflow");
    // Product fits but the byte size overflows.
    let mut e = entry("a", AprDtype::F64, &[4], 0);
    e.dims = vec![1 << 62];
    expect_index_err(&Craft::new(vec![e], 64), "no valid size");
    // Huge name_len.
    let mut e = entry("a", f32s(), &[4], 0);
    e.name_len = Some(u16::MAX);
    expect_index_err(&Craft::new(vec![e], 64), "name_len 65535");
    // Zero name_len.
    let mut e = entry("a", f32s(), &[4], 0);
    e.name = Vec::new();
    expect_index_err(&Craft::new(vec![e], 64), "name_len 0");
    // A 257-byte name.
    expect_index_err(
        &Craft::new(vec![entry(&"x".repeat(257), f32s(), &[4], 0)], 64),
        "name_len 257",
    );
    // Invalid UTF-8.
    let mut e = entry("a", f32s(), &[4], 0);
    e.name = vec![0xFF, 0xFE];
    expect_index_err(&Craft::new(vec![e], 64), "UTF-8");
    // Unsorted and duplicate names.
    expect_index_err(
        &Craft::new(
            vec![entry("b", f32s(), &[4], 0), entry("a", f32s(), &[4], 64)],
            128,
        ),
        "sorted",
    );
    expect_index_err(
        &Craft::new(
            vec![entry("a", f32s(), &[4], 0), entry("a", f32s(), &[4], 64)],
            128,
        ),
        "sorted",
    );
    // Misaligned offset.
    expect_index_err(
        &Craft::new(vec![entry("a", f32s(), &[4], 8)], 64),
        "multiple of 64",
    );
    // Size that does not match dtype × dims.
    let mut e = entry("a", f32s(), &[4], 0);
    e.size = 15;
    expect_index_err(&Craft::new(vec![e], 64), "size 15");
    // Not a whole number of ggml blocks.
    let mut e = entry("a", AprDtype::Ggml(QType::Q4_K), &[256], 0);
    e.dims = vec![100];
    expect_index_err(&Craft::new(vec![e], 256), "no valid size");
    // Unknown dtype ids, incl. ggml Q4_1's id slot is F64 here, and 9 (ggml Q8_1 / legacy AprQ8).
    for id in [9u8, 15, 16, 31, 127, 130, 255] {
        let mut e = entry("a", f32s(), &[4], 0);
        e.dtype = id;
        expect_index_err(&Craft::new(vec![e], 64), &format!("unknown dtype id {id}"));
    }
    // Too many dims.
    let mut e = entry("a", AprDtype::U8, &[1; 9], 0);
    e.ndim = Some(9);
    expect_index_err(&Craft::new(vec![e], 64), "9 dims");
    // tensor_count larger than the entries present, and absurdly large.
    let mut c = Craft::new(vec![entry("a", f32s(), &[4], 0)], 64);
    c.count = Some(2);
    assert!(matches!(
        AprFile::from_bytes(c.build()),
        Err(AprError::Index(_))
    ));
    c.count = Some(u32::MAX);
    expect_index_err(&c, "cannot fit");
    // tensor_count smaller than the entries present.
    let mut c = Craft::new(
        vec![entry("a", f32s(), &[4], 0), entry("b", f32s(), &[4], 64)],
        128,
    );
    c.count = Some(1);
    expect_index_err(&c, "more than tensor_count");
    // Non-zero index padding.
    let mut c = Craft::new(vec![entry("a", f32s(), &[4], 0)], 64);
    c.index_pad = vec![0, 0, 7];
    expect_index_err(&c, "non-zero byte");
}

#[test]
fn hostile_layouts_and_metadata_are_refused() {
    let base = || Craft::new(vec![entry("a", f32s(), &[4], 0)], 64);
    let layout = |tweak: HeaderTweak| {
        let mut c = base();
        c.tweak = Some(tweak);
        AprFile::from_bytes(c.build())
    };
    assert!(matches!(
        layout(Box::new(|h| h.metadata_offset = 10)),
        Err(AprError::Layout(_))
    ));
    assert!(matches!(
        layout(Box::new(|h| h.metadata_offset = u64::MAX)),
        Err(AprError::Layout(_))
    ));
    assert!(matches!(
        layout(Box::new(|h| h.metadata_size = 1000)),
        Err(AprError::Layout(_))
    ));
    assert!(matches!(
        layout(Box::new(|h| h.tensor_index_offset = h.data_offset + 64)),
        Err(AprError::Layout(_))
    ));
    assert!(matches!(
        layout(Box::new(|h| h.data_offset += 8)),
        Err(AprError::Layout(_))
    ));
    assert!(matches!(
        layout(Box::new(|h| h.data_offset = 1 << 40)),
        Err(AprError::Layout(_))
    ));
    assert!(matches!(
        layout(Box::new(|h| h.data_offset = u64::MAX)),
        Err(AprError::Layout(_))
    ));

    for (meta, needle) in [
        (&b"[1,2]"[..], "JSON object"),
        (b"\"s\"", "JSON object"),
        (b"{\"a\":", "not valid JSON"),
        (b"{\"a\":\"\xff\"}", "not valid JSON"),
        (b"", "not valid JSON"),
    ] {
        let mut c = base();
        c.meta = meta.to_vec();
        match AprFile::from_bytes(c.build()) {
            Err(AprError::Metadata(m)) => assert!(m.contains(needle), "{m}"),
            other => panic!("{meta:?}: {other:?}"),
        }
    }
    // Deep nesting is refused by serde_json's recursion limit, not the stack.
    let mut c = base();
    c.meta = format!("{{\"a\":{}{}}}", "[".repeat(100_000), "]".repeat(100_000)).into_bytes();
    assert!(matches!(
        AprFile::from_bytes(c.build()),
        Err(AprError::Metadata(_))
    ));
}

// ---------------------------------------------------------------------------------------
// Deterministic corruption suite.

/// Byte ranges of a valid uncompressed file whose content the reader does not interpret:
/// reserved header bytes, metadata padding and tensor padding. Index padding is not among
/// them (it must be zero).
fn dont_care(b: &[u8]) -> Vec<std::ops::Range<usize>> {
    let f = AprFile::from_bytes(b.to_vec()).unwrap();
    let h = f.header();
    let mut r = Vec::new();
    r.push(44..64); // reserved header bytes
    r.push(
        (h.metadata_offset + u64::from(h.metadata_size)) as usize..h.tensor_index_offset as usize,
    );
    let mut spans: Vec<(usize, usize)> = f
        .tensors()
        .iter()
        .map(|t| (f.tensor_offset(t), f.tensor_offset(t) + t.size as usize))
        .collect();
    spans.sort();
    let end = b.len() - 4;
    for (i, &(_, e)) in spans.iter().enumerate() {
        let next = spans.get(i + 1).map_or(end, |s| s.0);
        if next > e {
            r.push(e..next);
        }
    }
    r
}

#[test]
fn corruption_suite_3000_cases() {
    let meta = sample_metadata();
    let specs = vec![
        spec("blk.0.attn_q.weight", AprDtype::Ggml(QType::Q4_0), &[2, 32]),
        spec("blk.0.attn_norm.weight", AprDtype::Ggml(QType::F32), &[7]),
        spec("output.weight", AprDtype::Q8, &[3, 3]),
        spec("token_embd.weight", AprDtype::Q4, &[1, 40]),
        spec("pos", AprDtype::I32, &[3]),
    ];
    let bases: Vec<(Compression, Vec<u8>)> =
        [Compression::None, Compression::Lz4, Compression::Zstd]
            .into_iter()
            .map(|c| (c, write_bytes(&meta, &specs, c)))
            .collect();
    let wants: Vec<_> = bases
        .iter()
        .map(|(_, b)| meaning(&AprFile::from_bytes(b.clone()).unwrap()))
        .collect();
    let free = dont_care(&bases[0].1);

    let mut rng = Rng(0x5EED_0A9B_2026_0001);
    let (mut errs, mut oks, mut same) = (0, 0, 0);
    let mut slowest = Duration::ZERO;
    let start = Instant::now();
    for case in 0..3000 {
        // Half the cases hit the uncompressed file, whose CRCs can be re-fixed everywhere.
        let which = if case % 2 == 0 { 0 } else { 1 + rng.below(2) };
        let (codec, base) = (&bases[which].0, &bases[which].1);
        let mut b = base.clone();
        let truncate = rng.below(4) == 0;
        let mut flipped = Vec::new();
        if truncate {
            b.truncate(rng.below(base.len()));
        } else {
            for _ in 0..1 + rng.below(4) {
                // Mostly the structured front of the file, sometimes anywhere.
                let limit = if rng.below(3) == 0 {
                    b.len()
                } else {
                    512.min(b.len())
                };
                let at = rng.below(limit);
                b[at] ^= 1 + rng.below(255) as u8;
                flipped.push(at);
            }
        }
        let refix = rng.below(2) == 0;
        if refix {
            if *codec == Compression::None {
                fix_crcs(&mut b);
            } else if b.len() >= 64 {
                fix_header_crc(&mut b);
            }
        }
        let unchanged = b == *base;
        let only_free =
            !truncate && refix && flipped.iter().all(|&a| free.iter().any(|r| r.contains(&a)));

        let t0 = Instant::now();
        let r = AprFile::from_bytes(b);
        slowest = slowest.max(t0.elapsed());
        match r {
            Err(_) => {
                errs += 1;
                assert!(!unchanged, "case {case}: unchanged bytes were refused");
                assert!(
                    !(only_free && which == 0),
                    "case {case}: a flip in padding was refused"
                );
            }
            Ok(f) => {
                oks += 1;
                check_invariants(&f);
                let m = meaning(&f);
                if unchanged || (only_free && which == 0) {
                    assert_eq!(m, wants[which], "case {case}");
                }
                if m == wants[which] {
                    same += 1;
                } else {
                    // Only a re-fixed uncompressed file may change meaning and still parse (a
                    // flip in tensor bytes, a metadata string, a truncated trailing pad...).
                    assert!(
                        refix && which == 0,
                        "case {case} ({codec:?}): corrupted bytes accepted without re-fixed CRCs"
                    );
                }
            }
        }
    }
    eprintln!("corruption suite: {errs} errors, {oks} accepted ({same} unchanged in meaning), slowest {slowest:?}, total {:?}", start.elapsed());
    assert!(errs > 2000, "{errs}");
    assert!(slowest < Duration::from_secs(1), "{slowest:?}");
}

// ---------------------------------------------------------------------------------------
// Decompression bombs and limits.

#[test]
fn decompress_limit_logic() {
    let o = AprReadOptions::default();
    assert_eq!(o.decompress_limit(0), 256 << 20);
    assert_eq!(o.decompress_limit(4096), 256 << 20);
    assert_eq!(o.decompress_limit(1 << 20), 1000 << 20);
    assert_eq!(o.decompress_limit(1 << 30), 64 << 30);
    assert_eq!(o.decompress_limit(u64::MAX), 64 << 30);
}

/// A compressed file whose header (CRC-valid) describes `data_len` bytes of tensor data,
/// while the stream actually carries `stream_zeros` more zero bytes after the index.
fn bomb(codec: Compression, valid_index: bool, stream_zeros: u64) -> Vec<u8> {
    let mut c = Craft::new(vec![entry("a", f32s(), &[16], 0)], 64);
    if !valid_index {
        c.count = Some(3); // phase 1 cannot parse the index
    }
    let plain = c.build();
    let data_off = AprHeader::parse(plain[..64].try_into().unwrap()).data_offset as usize;
    let mut head = plain[..64].to_vec();
    let f = u16::from_le_bytes([head[6], head[7]])
        | if codec == Compression::Lz4 {
            flags::LZ4
        } else {
            flags::ZSTD
        };
    head[6..8].copy_from_slice(&f.to_le_bytes());
    fix_header_crc(&mut head);
    let body = &plain[64..data_off];
    let mut out = head;
    use std::io::Read as _;
    let mut zeros = std::io::repeat(0).take(stream_zeros);
    match codec {
        Compression::Zstd => {
            let mut e = zstd::stream::write::Encoder::new(&mut out, 1).unwrap();
            e.write_all(body).unwrap();
            std::io::copy(&mut zeros, &mut e).unwrap();
            e.finish().unwrap();
        }
        Compression::Lz4 => {
            let mut e = lz4_flex::frame::FrameEncoder::new(&mut out);
            e.write_all(body).unwrap();
            std::io::copy(&mut zeros, &mut e).unwrap();
            e.finish().unwrap();
        }
        Compression::None => unreachable!(),
    }
    out
}

#[test]
fn bomb_with_valid_index_stops_at_what_the_index_describes() {
    for codec in [Compression::Zstd, Compression::Lz4] {
        let b = bomb(codec, true, 64 << 20);
        assert!(b.len() < 1 << 20, "{codec:?} bomb is {} bytes", b.len());
        let t0 = Instant::now();
        let (r, peak) = peak_heap(|| AprFile::from_bytes(b));
        let took = t0.elapsed();
        match r {
            Err(AprError::TooLarge { limit, .. }) => assert!(limit < 128 << 10, "{limit}"),
            other => panic!("{codec:?}: {other:?}"),
        }
        assert!(peak < 8 << 20, "{codec:?}: peak heap {peak} bytes");
        assert!(took < Duration::from_secs(2), "{took:?}");
    }
}

#[test]
fn bomb_with_broken_index_stops_at_the_size_limit() {
    // An explicit small limit: LZ4 and zstd.
    let opts = AprReadOptions {
        decompress_floor: 8 << 20,
        decompress_ratio: 1,
        ..AprReadOptions::default()
    };
    for codec in [Compression::Zstd, Compression::Lz4] {
        let b = bomb(codec, false, 64 << 20);
        let (r, peak) = peak_heap(|| AprFile::from_bytes_with(b, &opts));
        match r {
            Err(AprError::TooLarge {
                what: "file",
                limit,
            }) => assert_eq!(limit, 8 << 20),
            other => panic!("{codec:?}: {other:?}"),
        }
        assert!(
            peak < (8 << 20) + (2 << 20),
            "{codec:?}: peak heap {peak} bytes"
        );
    }
    // The default limit: a ~10 KB zstd file expanding to 300 MiB stops at 256 MiB.
    let b = bomb(Compression::Zstd, false, 300 << 20);
    assert!(b.len() < 64 << 10, "{}", b.len());
    let t0 = Instant::now();
    let (r, peak) = peak_heap(|| AprFile::from_bytes(b));
    assert!(
        matches!(r, Err(AprError::TooLarge { limit, .. }) if limit == 256 << 20),
        "{r:?}"
    );
    assert!(peak <= (256 << 20) + (1 << 20), "peak heap {peak} bytes");
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
}

#[test]
fn header_data_offset_past_the_limit_is_refused_before_decoding() {
    let mut b = bomb(Compression::Zstd, true, 0);
    let mut h = AprHeader::parse(b[..64].try_into().unwrap());
    h.data_offset = 1 << 40;
    b[..64].copy_from_slice(&h.to_bytes());
    fix_header_crc(&mut b);
    let (r, peak) = peak_heap(|| AprFile::from_bytes(b));
    assert!(matches!(r, Err(AprError::TooLarge { .. })), "{r:?}");
    assert!(peak < 1 << 20);
}

#[test]
fn garbage_compressed_payloads_are_decompress_errors() {
    let plain = small_plain();
    for (flag, magic) in [
        (flags::ZSTD, [0x28u8, 0xB5, 0x2F, 0xFD]),
        (flags::LZ4, [0x04, 0x22, 0x4D, 0x18]),
    ] {
        let mut b = plain[..64].to_vec();
        let f = u16::from_le_bytes([b[6], b[7]]) | flag;
        b[6..8].copy_from_slice(&f.to_le_bytes());
        fix_header_crc(&mut b);
        b.extend_from_slice(&magic);
        b.extend((0..200u32).map(|i| (i * 37) as u8));
        assert!(matches!(
            AprFile::from_bytes(b),
            Err(AprError::Decompress(_))
        ));
    }
    // Valid frame followed by trailing junk.
    let mut b = write_bytes(&sample_metadata(), &every_dtype(), Compression::Zstd);
    b.extend_from_slice(b"junk");
    assert!(AprFile::from_bytes(b).is_err());
}

// ---------------------------------------------------------------------------------------
// Writer errors.

#[test]
fn writer_refuses_bad_specs_and_wrong_sizes_without_leaving_files() {
    let dir = TempDir::new("werr");
    let p = dir.path("out.apr");
    let meta = Map::new();
    let mut fill = |_: &str, out: &mut dyn Write| out.write_all(&[0u8; 16]);
    let bad = |specs: Vec<AprTensorSpec>| {
        write_apr(&p, &meta, &specs, Compression::None, &mut |_, _| Ok(()))
    };
    assert!(matches!(
        bad(vec![spec("a", f32s(), &[4]), spec("a", f32s(), &[4])]),
        Err(AprError::InvalidSpec(_))
    ));
    assert!(matches!(
        bad(vec![spec("a", AprDtype::Ggml(QType::Q4_1), &[32])]),
        Err(AprError::InvalidSpec(_))
    ));
    assert!(matches!(
        bad(vec![spec("a", AprDtype::Ggml(QType::Q4_K), &[100])]),
        Err(AprError::InvalidSpec(_))
    ));
    assert!(matches!(
        bad(vec![spec("", f32s(), &[4])]),
        Err(AprError::InvalidSpec(_))
    ));
    assert!(matches!(
        bad(vec![spec(&"n".repeat(257), f32s(), &[4])]),
        Err(AprError::InvalidSpec(_))
    ));
    assert!(matches!(
        bad(vec![spec("a", f32s(), &[1; 9])]),
        Err(AprError::InvalidSpec(_))
    ));
    assert!(matches!(
        bad(vec![spec("a", f32s(), &[u64::MAX, 2])]),
        Err(AprError::InvalidSpec(_))
    ));

    // Too few bytes, too many, and a callback error.
    for (n, codec) in [
        (12usize, Compression::None),
        (20, Compression::Zstd),
        (4, Compression::Lz4),
    ] {
        let r = write_apr(
            &p,
            &meta,
            &[spec("a", f32s(), &[4])],
            codec,
            &mut |_, out| out.write_all(&vec![1u8; n]),
        );
        match r {
            Err(AprError::TensorData {
                name,
                expected: 16,
                written,
            }) => {
                assert_eq!(name, "a");
                assert_eq!(written, n as u64);
            }
            other => panic!("{n}: {other:?}"),
        }
    }
    let r = write_apr(
        &p,
        &meta,
        &[spec("a", f32s(), &[4])],
        Compression::None,
        &mut |_, _| Err(std::io::Error::other("source went away")),
    );
    assert!(matches!(r, Err(AprError::Io(_))));
    assert!(!p.exists(), "no partial file at the destination");
    assert_eq!(
        std::fs::read_dir(&dir.0).unwrap().count(),
        0,
        "temporary files are removed"
    );

    // And it works once the sizes are right.
    write_apr(
        &p,
        &meta,
        &[spec("a", f32s(), &[4])],
        Compression::None,
        &mut fill,
    )
    .unwrap();
    assert_eq!(AprFile::open(&p).unwrap().tensors().len(), 1);
    assert_eq!(std::fs::read_dir(&dir.0).unwrap().count(), 1);

    // An empty model is fine.
    write_apr(&p, &Map::new(), &[], Compression::Zstd, &mut fill).unwrap();
    let f = AprFile::open(&p).unwrap();
    assert!(f.tensors().is_empty() && f.metadata().is_empty());
    assert_eq!(f.flags() & flags::QUANTIZED, 0);
}

#[test]
fn open_refuses_non_regular_files() {
    let dir = TempDir::new("nonreg");
    match AprFile::open(&dir.0) {
        Err(AprError::NotRegularFile { kind, .. }) => assert_eq!(kind, "a directory"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        AprFile::open(dir.path("missing.apr")),
        Err(AprError::Io(_))
    ));
    let fifo = dir.path("pipe.apr");
    match std::process::Command::new("mkfifo").arg(&fifo).status() {
        Ok(s) if s.success() => {
            // Must answer at once: opening a FIFO for reading would block forever.
            match AprFile::open(&fifo) {
                Err(AprError::NotRegularFile { kind, .. }) => assert_eq!(kind, "a FIFO"),
                other => panic!("{other:?}"),
            }
        }
        _ => eprintln!("skipped the FIFO case: no mkfifo"),
    }
    let empty = dir.path("empty.apr");
    std::fs::write(&empty, b"").unwrap();
    assert!(matches!(
        AprFile::open(&empty),
        Err(AprError::Truncated { .. })
    ));
}

#[test]
fn errors_convert_to_kiln_errors() {
    use kiln_core::Error as K;
    assert!(matches!(K::from(AprError::Index("x".into())), K::Format(m) if m.starts_with("APR")));
    assert!(matches!(
        K::from(AprError::UnsupportedVersion { major: 3, minor: 0 }),
        K::Unsupported(_)
    ));
    assert!(matches!(
        K::from(AprError::Io(std::io::Error::other("x"))),
        K::Io(_)
    ));
    assert!(matches!(
        K::from(AprError::OutOfMemory { bytes: 1 }),
        K::OutOfMemory(_)
    ));
    assert!(matches!(
        K::from(AprError::InvalidSpec("x".into())),
        K::InvalidArgument(_)
    ));
}

// ---------------------------------------------------------------------------------------
// Fuzz seed corpus: regenerated on demand, exercised by a stable harness.

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/apr_reader")
}

/// `cargo test --release -p kiln-formats --test apr_container -- --ignored regenerate`
/// rewrites the committed seed corpus.
#[test]
#[ignore]
fn regenerate_fuzz_corpus() {
    let dir = corpus_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let specs = vec![
        spec("blk.0.w", AprDtype::Ggml(QType::Q8_0), &[2, 32]),
        spec("norm", AprDtype::Ggml(QType::F32), &[8]),
        spec("q4", AprDtype::Q4, &[40]),
        spec("q8", AprDtype::Q8, &[6]),
    ];
    let mut meta = Map::new();
    meta.insert("architecture".into(), json!("llama"));
    meta.insert("tokenizer.vocabulary".into(), json!(["a", "b"]));
    for (name, c) in [
        ("plain.apr", Compression::None),
        ("lz4.apr", Compression::Lz4),
        ("zstd.apr", Compression::Zstd),
    ] {
        write_file(&dir.join(name), &meta, &specs, c);
    }
    write_apr(
        &dir.join("empty.apr"),
        &Map::new(),
        &[],
        Compression::None,
        &mut |_, _| Ok(()),
    )
    .unwrap();
    let mut b = std::fs::read(dir.join("plain.apr")).unwrap();
    b[6] |= flags::LZ4 as u8;
    fix_crcs(&mut b);
    std::fs::write(dir.join("flag_only_lz4.apr"), b).unwrap();
    let c = Craft::new(
        vec![
            entry("a", f32s(), &[4], 0),
            entry("b", AprDtype::I64, &[2], 64),
        ],
        128,
    );
    std::fs::write(dir.join("crafted.apr"), c.build()).unwrap();
}

#[test]
fn fuzz_corpus_under_a_stable_harness() {
    let mut files: Vec<PathBuf> = std::fs::read_dir(corpus_dir())
        .expect("fuzz/corpus/apr_reader exists")
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(files.len() >= 4, "{files:?}");
    let mut rng = Rng(0xF022_C0DE_0000_0001);
    let start = Instant::now();
    let mut slowest = Duration::ZERO;
    let mut accepted = 0;
    for path in &files {
        let seed = std::fs::read(path).unwrap();
        assert!(
            seed.len() < 4096,
            "{} is {} bytes",
            path.display(),
            seed.len()
        );
        let f =
            AprFile::from_bytes(seed.clone()).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        check_invariants(&f);
        for _ in 0..1000 {
            let mut b = seed.clone();
            for _ in 0..1 + rng.below(3) {
                match rng.below(6) {
                    0 => b.truncate(rng.below(b.len() + 1)),
                    1 if !b.is_empty() => {
                        let at = rng.below(b.len());
                        b.insert(at, rng.next() as u8);
                    }
                    2 if !b.is_empty() => {
                        let at = rng.below(b.len());
                        b.remove(at);
                    }
                    3 if b.len() >= 8 => {
                        // An interesting value over a u16/u32/u64 field.
                        let at = rng.below(b.len() - 8);
                        let v: u64 = [
                            0,
                            1,
                            63,
                            64,
                            65,
                            255,
                            256,
                            u64::from(u32::MAX),
                            u64::MAX,
                            1 << 40,
                        ][rng.below(10)];
                        let w = [2usize, 4, 8][rng.below(3)];
                        b[at..at + w].copy_from_slice(&v.to_le_bytes()[..w]);
                    }
                    _ if !b.is_empty() => {
                        let at = rng.below(b.len());
                        b[at] ^= 1 << rng.below(8);
                    }
                    _ => {}
                }
            }
            if rng.below(2) == 0 {
                fix_crcs(&mut b);
            }
            let t0 = Instant::now();
            if let Ok(f) = AprFile::from_bytes(b) {
                accepted += 1;
                check_invariants(&f);
            }
            slowest = slowest.max(t0.elapsed());
        }
    }
    eprintln!(
        "fuzz harness: {} inputs, {accepted} accepted, slowest {slowest:?}, total {:?}",
        files.len() * 1001,
        start.elapsed()
    );
    assert!(start.elapsed() < Duration::from_secs(20));
}

// ---------------------------------------------------------------------------------------
// The independent Python checker.

#[test]
fn python_checker_agrees() {
    if std::process::Command::new("python3")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("skipped: no python3");
        return;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/check/apr_check.py");
    let dir = TempDir::new("py");
    let run = |p: &Path| {
        let out = std::process::Command::new("python3")
            .arg(&script)
            .arg(p)
            .arg("-v")
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let good = dir.path("good.apr");
    write_file(&good, &sample_metadata(), &every_dtype(), Compression::None);
    let (code, out) = run(&good);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains(": OK:"), "{out}");
    assert!(
        out.contains(&format!("{} tensors", every_dtype().len())),
        "{out}"
    );

    // What kiln refuses, the checker refuses too.
    let raw = std::fs::read(&good).unwrap();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("header crc", {
            let mut b = raw.clone();
            b[9] ^= 1;
            b
        }),
        ("file crc", {
            let mut b = raw.clone();
            let n = b.len();
            b[n - 10] ^= 1;
            b
        }),
        (
            "overlap",
            Craft::new(
                vec![entry("a", f32s(), &[32], 0), entry("b", f32s(), &[4], 64)],
                256,
            )
            .build(),
        ),
        (
            "unsorted",
            Craft::new(
                vec![entry("b", f32s(), &[4], 0), entry("a", f32s(), &[4], 64)],
                128,
            )
            .build(),
        ),
        (
            "misaligned",
            Craft::new(vec![entry("a", f32s(), &[4], 8)], 64).build(),
        ),
        (
            "out of range",
            Craft::new(vec![entry("a", f32s(), &[32], 64)], 128).build(),
        ),
        ("size", {
            let mut e = entry("a", f32s(), &[4], 0);
            e.size = 15;
            Craft::new(vec![e], 64).build()
        }),
    ];
    for (what, bytes) in cases {
        assert!(AprFile::from_bytes(bytes.clone()).is_err(), "{what}");
        let p = dir.path("bad.apr");
        std::fs::write(&p, &bytes).unwrap();
        let (code, out) = run(&p);
        assert_eq!(code, Some(1), "{what}: {out}");
        assert!(out.contains("error:"), "{what}: {out}");
    }
}
