//! Malformed and hostile GGUF files: each defect must come back as its own typed error,
//! without a panic and without allocating what the file merely claims.

use std::sync::Arc;

use kiln_core::QType;
use kiln_formats::gguf::{GgufError, GgufFile, GgufWriter};

/// Assembles GGUF bytes field by field, so tests can write what no honest writer would.
#[derive(Default)]
struct Raw(Vec<u8>);

impl Raw {
    fn header(version: u32, n_tensors: u64, n_kv: u64) -> Raw {
        let mut r = Raw::default();
        r.0.extend_from_slice(b"GGUF");
        r.u32(version).u64(n_tensors).u64(n_kv);
        r
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64);
        self.0.extend_from_slice(s.as_bytes());
        self
    }
    fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.str(key).u32(4).u32(v)
    }
    fn tensor(&mut self, name: &str, dims: &[u64], qtype: u32, offset: u64) -> &mut Self {
        self.str(name).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(qtype).u64(offset)
    }
    /// Pads to 32 and appends `n` data bytes.
    fn data(&mut self, n: usize) -> &mut Self {
        let padded = self.0.len().next_multiple_of(32);
        self.0.resize(padded + n, 0xAB);
        self
    }
    fn parse(&self) -> Result<GgufFile, GgufError> {
        GgufFile::from_storage(Arc::new(self.0.clone()))
    }
}

/// A small valid file whose last tensor ends exactly at the end of the file, so any proper
/// prefix of it is missing something.
fn small_valid() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "llama").unwrap();
    w.add_kv("some.count", 7u32).unwrap();
    w.add_kv("some.names", vec!["a", "bc", ""]).unwrap();
    w.add_kv("some.scores", vec![0.5f32, 1.5]).unwrap();
    w.add_tensor("w", QType::Q8_0, vec![32, 2], vec![1; 68])
        .unwrap();
    w.add_tensor("v", QType::F32, vec![8], vec![2; 32]).unwrap();
    w.write_to(Vec::new()).unwrap()
}

#[test]
fn small_valid_file_parses() {
    let f = GgufFile::from_storage(Arc::new(small_valid())).unwrap();
    assert_eq!(f.tensors().len(), 2);
    assert_eq!(
        f.data_offset() + f.tensor("v").unwrap().offset + 32,
        f.file_len()
    );
}

#[test]
fn every_truncation_is_a_typed_error() {
    let full = small_valid();
    for len in 0..full.len() {
        let err = GgufFile::from_storage(Arc::new(full[..len].to_vec()))
            .expect_err(&format!("prefix {len} parsed"));
        assert!(
            matches!(
                err,
                GgufError::Truncated { .. }
                    | GgufError::AbsurdCount { .. }
                    | GgufError::AbsurdLength { .. }
                    | GgufError::TensorOutOfBounds { .. }
            ),
            "prefix {len}: unexpected {err:?}"
        );
    }
    // The parts the header promises but do not fit in a short prefix are named precisely.
    let err = GgufFile::from_storage(Arc::new(full[..6].to_vec())).unwrap_err();
    assert!(
        matches!(
            err,
            GgufError::Truncated {
                what: "version",
                offset: 4
            }
        ),
        "{err:?}"
    );
}

#[test]
fn empty_file_on_disk_is_truncated() {
    let path = std::env::temp_dir().join(format!("kiln-gguf-empty-{}.gguf", std::process::id()));
    std::fs::write(&path, b"").unwrap();
    let r = GgufFile::open(&path);
    std::fs::remove_file(&path).unwrap();
    assert!(matches!(r, Err(GgufError::Truncated { .. })));
    assert!(matches!(
        GgufFile::open("/nonexistent/kiln.gguf"),
        Err(GgufError::Io(_))
    ));
}

#[test]
fn bad_magic_and_versions() {
    let mut b = small_valid();
    b[..4].copy_from_slice(b"GGML");
    assert!(
        matches!(GgufFile::from_storage(Arc::new(b)), Err(GgufError::BadMagic(m)) if &m == b"GGML")
    );
    for v in [0u32, 1, 4, u32::MAX, 3u32.swap_bytes()] {
        let r = Raw::header(v, 0, 0).parse();
        assert!(
            matches!(r, Err(GgufError::UnsupportedVersion(x)) if x == v),
            "version {v}: {r:?}"
        );
    }
    assert_eq!(Raw::header(2, 0, 0).parse().unwrap().version(), 2);
    assert_eq!(Raw::header(3, 0, 0).parse().unwrap().version(), 3);
}

#[test]
fn absurd_counts_and_lengths() {
    for (n_tensors, n_kv) in [(u64::MAX, 0), (0, u64::MAX), (1 << 40, 0), (0, 1 << 60)] {
        let r = Raw::header(3, n_tensors, n_kv).parse();
        assert!(
            matches!(r, Err(GgufError::AbsurdCount { .. })),
            "{n_tensors} {n_kv}: {r:?}"
        );
    }
    // Key length.
    let mut raw = Raw::header(3, 0, 1);
    raw.u64(u64::MAX).u32(4).u32(0);
    assert!(matches!(
        raw.parse(),
        Err(GgufError::AbsurdLength {
            what: "metadata key",
            value: u64::MAX
        })
    ));
    // String value length.
    let mut raw = Raw::header(3, 0, 1);
    raw.str("k").u32(8).u64(1 << 50);
    assert!(matches!(raw.parse(), Err(GgufError::AbsurdLength { value, .. }) if value == 1 << 50));
    // Array lengths, for a fixed-size element and for strings (8 bytes minimum each).
    for (elem, n) in [
        (0u32, u64::MAX),
        (12, 1 << 40),
        (8, 1 << 61),
        (9, u64::MAX / 12),
    ] {
        let mut raw = Raw::header(3, 0, 1);
        raw.str("k").u32(9).u32(elem).u64(n);
        raw.0.extend_from_slice(&[0; 64]);
        let r = raw.parse();
        assert!(
            matches!(r, Err(GgufError::AbsurdCount { what: "array element", value }) if value == n),
            "{r:?}"
        );
    }
    // A tensor name length.
    let mut raw = Raw::header(3, 1, 0);
    raw.u64(u64::MAX - 3);
    raw.0.extend_from_slice(&[0; 32]);
    assert!(matches!(
        raw.parse(),
        Err(GgufError::AbsurdLength {
            what: "tensor name",
            ..
        })
    ));
}

#[test]
fn unknown_type_ids() {
    let mut raw = Raw::header(3, 0, 1);
    raw.str("k").u32(13).u32(0);
    assert!(matches!(raw.parse(), Err(GgufError::UnknownValueType { key, id: 13 }) if key == "k"));
    let mut raw = Raw::header(3, 0, 1);
    raw.str("arr").u32(9).u32(99).u64(0);
    assert!(
        matches!(raw.parse(), Err(GgufError::UnknownValueType { key, id: 99 }) if key == "arr")
    );
    // ggml ids 4 and 5 (removed Q4_2/Q4_3) and ones past the end.
    for id in [4u32, 5, 24, 31, u32::MAX] {
        let mut raw = Raw::header(3, 1, 0);
        raw.tensor("t", &[32], id, 0).data(128);
        assert!(
            matches!(raw.parse(), Err(GgufError::UnknownQType { ref tensor, id: x }) if tensor == "t" && x == id)
        );
    }
}

#[test]
fn bad_tensor_shapes_and_offsets() {
    let mut raw = Raw::header(3, 1, 0);
    raw.tensor("t", &[1, 1, 1, 1, 1], 0, 0).data(4);
    assert!(matches!(
        raw.parse(),
        Err(GgufError::TooManyDims { n_dims: 5, .. })
    ));
    let mut raw = Raw::header(3, 1, 0);
    raw.str("t").u32(u32::MAX).data(64);
    assert!(matches!(raw.parse(), Err(GgufError::TooManyDims { .. })));

    for dims in [
        &[u64::MAX, 2][..],
        &[1 << 32, 1 << 32],
        &[1 << 62, 4],
        &[1 << 31, 1 << 31, 1 << 31],
        &[u64::MAX],
    ] {
        let mut raw = Raw::header(3, 1, 0);
        raw.tensor("big", dims, 0, 0).data(64);
        let r = raw.parse();
        assert!(
            matches!(r, Err(GgufError::DimsOverflow { ref name, .. }) if name == "big"),
            "{dims:?}: {r:?}"
        );
    }
    // Elements fit, but their bytes do not (f32 = 4 bytes each).
    let mut raw = Raw::header(3, 1, 0);
    raw.tensor("big", &[1 << 62], 0, 0).data(64);
    assert!(matches!(raw.parse(), Err(GgufError::DimsOverflow { .. })));

    let mut raw = Raw::header(3, 1, 0);
    raw.tensor("q", &[33], QType::Q4_0 as u32, 0).data(64);
    assert!(matches!(raw.parse(), Err(GgufError::BadShape { .. })));

    // Data past the end: by offset, by size, and an offset that would overflow.
    for (dims, offset) in [
        (&[8u64][..], 32u64),
        (&[9], 0),
        (&[8], u64::MAX - 31),
        (&[8], 1 << 40),
    ] {
        let mut raw = Raw::header(3, 1, 0);
        raw.tensor("t", dims, 0, offset).data(32);
        let r = raw.parse();
        assert!(
            matches!(r, Err(GgufError::TensorOutOfBounds { ref name, .. }) if name == "t"),
            "{dims:?} {offset}: {r:?}"
        );
    }
    let mut raw = Raw::header(3, 1, 0);
    raw.tensor("t", &[8], 0, 4).data(64);
    assert!(matches!(
        raw.parse(),
        Err(GgufError::MisalignedTensor {
            offset: 4,
            alignment: 32,
            ..
        })
    ));
}

#[test]
fn duplicates_alignment_and_utf8() {
    let mut raw = Raw::header(3, 0, 2);
    raw.kv_u32("k", 1).kv_u32("k", 2);
    assert!(matches!(raw.parse(), Err(GgufError::DuplicateKey(k)) if k == "k"));

    let mut raw = Raw::header(3, 2, 0);
    raw.tensor("t", &[8], 0, 0)
        .tensor("t", &[8], 0, 32)
        .data(64);
    assert!(matches!(raw.parse(), Err(GgufError::DuplicateTensor(t)) if t == "t"));

    for a in [0u32, 3, 48] {
        let mut raw = Raw::header(3, 0, 1);
        raw.kv_u32("general.alignment", a);
        assert!(matches!(raw.parse(), Err(GgufError::BadAlignment(x)) if x == a as u64));
    }
    let mut raw = Raw::header(3, 0, 1);
    raw.str("general.alignment").u32(8).str("32");
    assert!(matches!(raw.parse(), Err(GgufError::WrongType { .. })));
    // A huge power of two pushes the data section past the end of the file.
    let mut raw = Raw::header(3, 1, 1);
    raw.str("general.alignment").u32(10).u64(1 << 63);
    raw.tensor("t", &[8], 0, 0).data(64);
    assert!(
        matches!(raw.parse(), Err(GgufError::TensorOutOfBounds { start, .. }) if start == 1 << 63)
    );

    let mut raw = Raw::header(3, 0, 1);
    raw.u64(2);
    raw.0.extend_from_slice(&[0xC3, 0x28]);
    raw.u32(4).u32(0);
    assert!(matches!(
        raw.parse(),
        Err(GgufError::BadUtf8 {
            what: "metadata key",
            offset: 32
        })
    ));
}

#[test]
fn deep_nesting_is_refused_before_the_stack_is() {
    // 10_000 nested one-element arrays: 12 bytes each.
    let mut raw = Raw::header(3, 0, 1);
    raw.str("deep").u32(9);
    for _ in 0..10_000 {
        raw.u32(9).u64(1);
    }
    raw.u32(0).u64(0);
    assert!(matches!(raw.parse(), Err(GgufError::NestingTooDeep { key }) if key == "deep"));
}

#[test]
fn converts_into_core_errors() {
    let e: kiln_core::Error = GgufError::BadMagic(*b"abcd").into();
    assert!(
        matches!(e, kiln_core::Error::Format(ref m) if m.contains("magic")),
        "{e}"
    );
    let io = std::io::Error::new(std::io::ErrorKind::NotFound, "gone");
    assert!(matches!(
        kiln_core::Error::from(GgufError::Io(io)),
        kiln_core::Error::Io(_)
    ));
}
