//! GGUF write → read: every metadata type, nested and empty arrays, unicode, tensors of
//! several qtypes under the default and custom alignments, streaming output.

use std::sync::Arc;

use kiln_core::QType;
use kiln_formats::gguf::{GgufArray, GgufError, GgufFile, GgufType, GgufValue, GgufWriter};

/// Deterministic pseudo-random bytes (a test needs no crypto, just distinct contents).
fn bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn every_value() -> Vec<(&'static str, GgufValue)> {
    vec![
        ("t.u8", GgufValue::U8(255)),
        ("t.i8", GgufValue::I8(-128)),
        ("t.u16", GgufValue::U16(65535)),
        ("t.i16", GgufValue::I16(-32768)),
        ("t.u32", GgufValue::U32(u32::MAX)),
        ("t.i32", GgufValue::I32(i32::MIN)),
        ("t.f32", GgufValue::F32(-1.5e-7)),
        ("t.f32.inf", GgufValue::F32(f32::INFINITY)),
        ("t.bool.true", GgufValue::Bool(true)),
        ("t.bool.false", GgufValue::Bool(false)),
        ("t.string", GgufValue::String("hello".into())),
        ("t.string.empty", GgufValue::String(String::new())),
        (
            "t.string.unicode",
            GgufValue::String("Grüße, 世界 🦀 \u{0}\n\t".into()),
        ),
        ("t.u64", GgufValue::U64(u64::MAX)),
        ("t.i64", GgufValue::I64(i64::MIN)),
        ("t.f64", GgufValue::F64(std::f64::consts::PI)),
        ("t.arr.u8", GgufArray::U8(vec![0, 1, 255]).into()),
        ("t.arr.i8", GgufArray::I8(vec![-1, 0, 127]).into()),
        ("t.arr.u16", GgufArray::U16(vec![1, 65535]).into()),
        ("t.arr.i16", GgufArray::I16(vec![-2, 2]).into()),
        ("t.arr.u32", GgufArray::U32(vec![7, u32::MAX]).into()),
        ("t.arr.i32", GgufArray::I32(vec![-7, i32::MAX]).into()),
        ("t.arr.f32", GgufArray::F32(vec![0.5, -0.25, 1e30]).into()),
        (
            "t.arr.bool",
            GgufArray::Bool(vec![true, false, true]).into(),
        ),
        (
            "t.arr.string",
            GgufArray::String(vec!["a".into(), String::new(), "ü🦀".into()]).into(),
        ),
        ("t.arr.u64", GgufArray::U64(vec![u64::MAX, 0]).into()),
        ("t.arr.i64", GgufArray::I64(vec![i64::MIN, i64::MAX]).into()),
        ("t.arr.f64", GgufArray::F64(vec![1e-300, -2.0]).into()),
        ("t.arr.empty.u32", GgufArray::U32(vec![]).into()),
        ("t.arr.empty.string", GgufArray::String(vec![]).into()),
        ("t.arr.empty.array", GgufArray::Array(vec![]).into()),
        (
            "t.arr.nested",
            GgufArray::Array(vec![
                GgufArray::I32(vec![1, 2, 3]),
                GgufArray::String(vec!["x".into()]),
                GgufArray::Array(vec![GgufArray::F32(vec![]), GgufArray::Bool(vec![false])]),
                GgufArray::U8(vec![]),
            ])
            .into(),
        ),
        ("键.ключ.🔑", GgufValue::String("unicode key".into())),
        ("", GgufValue::U8(0)),
    ]
}

struct T {
    name: &'static str,
    qtype: QType,
    dims: Vec<usize>,
}

fn tensors() -> Vec<T> {
    vec![
        T {
            name: "a.f32",
            qtype: QType::F32,
            dims: vec![3, 5],
        },
        T {
            name: "b.f16",
            qtype: QType::F16,
            dims: vec![7],
        },
        T {
            name: "c.q4_0",
            qtype: QType::Q4_0,
            dims: vec![64, 3],
        },
        T {
            name: "d.q8_0",
            qtype: QType::Q8_0,
            dims: vec![32, 2, 2],
        },
        T {
            name: "e.q4_k",
            qtype: QType::Q4_K,
            dims: vec![256, 3],
        },
        T {
            name: "f.q6_k",
            qtype: QType::Q6_K,
            dims: vec![512, 1, 1, 2],
        },
        T {
            name: "g.bf16",
            qtype: QType::BF16,
            dims: vec![1],
        },
        T {
            name: "h.empty",
            qtype: QType::F32,
            dims: vec![0, 4],
        },
        T {
            name: "i.q4_1",
            qtype: QType::Q4_1,
            dims: vec![32],
        },
    ]
}

fn build(alignment: Option<u32>) -> (GgufWriter, Vec<Vec<u8>>) {
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "test").unwrap();
    if let Some(a) = alignment {
        w.add_kv("general.alignment", a).unwrap();
    }
    for (k, v) in every_value() {
        w.add_kv(k, v).unwrap();
    }
    let mut datas = Vec::new();
    for (i, t) in tensors().into_iter().enumerate() {
        let data = bytes(i as u64 + 1, t.qtype.tensor_bytes(&t.dims).unwrap());
        w.add_tensor(t.name, t.qtype, t.dims, data.clone()).unwrap();
        datas.push(data);
    }
    (w, datas)
}

fn check_file(f: &GgufFile, alignment: u64, datas: &[Vec<u8>]) {
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), alignment);
    assert_eq!(f.data_offset() % alignment, 0);
    // Metadata in file order, all values equal.
    let mut expected: Vec<(String, GgufValue)> =
        vec![("general.architecture".into(), "test".into())];
    if alignment != 32 {
        expected.push(("general.alignment".into(), GgufValue::U32(alignment as u32)));
    }
    expected.extend(every_value().into_iter().map(|(k, v)| (k.to_string(), v)));
    assert_eq!(f.metadata(), expected.as_slice());
    for (k, v) in &expected {
        assert_eq!(f.get(k), Some(v), "{k}");
    }
    assert_eq!(f.get("no.such.key"), None);

    let storage = f.storage().clone();
    let base = storage.as_ptr() as usize;
    assert_eq!(f.tensors().len(), datas.len());
    for (t, (info, data)) in tensors().iter().zip(f.tensors().iter().zip(datas)) {
        assert_eq!(info.name, t.name);
        assert_eq!(info.qtype, t.qtype);
        assert_eq!(info.dims, t.dims);
        assert_eq!(info.n_bytes, data.len());
        assert_eq!(
            info.offset % alignment,
            0,
            "{} offset {}",
            t.name,
            info.offset
        );
        assert_eq!(f.tensor(t.name), Some(info));
        let view = f.view(info).unwrap();
        assert_eq!(view.bytes(), data.as_slice(), "{}", t.name);
        assert_eq!(view.dims(), t.dims.as_slice());
        assert_eq!(view.qtype(), t.qtype);
        // Zero-copy: the view's bytes lie inside the file's storage, at the declared place.
        let at = view.bytes().as_ptr() as usize - base;
        assert_eq!(at as u64, f.data_offset() + info.offset);
        assert_eq!(at as u64 % alignment, 0);
    }
    assert!(f.tensor("missing").is_none());
}

#[test]
fn round_trip_default_alignment() {
    let (w, datas) = build(None);
    let expected_len = w.file_len();
    let buf = w.write_to(Vec::new()).unwrap();
    assert_eq!(buf.len() as u64, expected_len);
    let f = GgufFile::from_storage(Arc::new(buf)).unwrap();
    check_file(&f, 32, &datas);
}

#[test]
fn round_trip_custom_alignments() {
    for a in [1u32, 8, 64, 4096] {
        let (w, datas) = build(Some(a));
        let buf = w.write_to(Vec::new()).unwrap();
        let f = GgufFile::from_storage(Arc::new(buf)).unwrap();
        check_file(&f, a as u64, &datas);
    }
}

#[test]
fn round_trip_through_a_file_on_disk() {
    let (w, datas) = build(Some(64));
    let path =
        std::env::temp_dir().join(format!("kiln-gguf-roundtrip-{}.gguf", std::process::id()));
    w.write_file(&path).unwrap();
    let f = GgufFile::open(&path);
    std::fs::remove_file(&path).unwrap();
    check_file(&f.unwrap(), 64, &datas);
}

#[test]
fn accessors_convert_between_integer_widths_and_reject_other_types() {
    let (w, _) = build(None);
    let f = GgufFile::from_storage(Arc::new(w.write_to(Vec::new()).unwrap())).unwrap();
    assert_eq!(f.get_u64("t.u8"), Some(255));
    assert_eq!(f.get_u64("t.u32"), Some(u32::MAX as u64));
    assert_eq!(f.get_u64("t.i8"), None, "negative values are not unsigned");
    assert_eq!(f.get_i64("t.i64"), Some(i64::MIN));
    assert_eq!(f.get_i64("t.u64"), None, "u64::MAX does not fit i64");
    assert_eq!(f.get_f32("t.f32"), Some(-1.5e-7));
    assert_eq!(f.get_f32("t.u16"), Some(65535.0));
    assert_eq!(f.get_f32("t.string"), None);
    assert_eq!(f.get_bool("t.bool.true"), Some(true));
    assert_eq!(
        f.get_str("t.string.unicode"),
        Some("Grüße, 世界 🦀 \u{0}\n\t")
    );
    assert_eq!(f.get_str("t.u8"), None);
    assert_eq!(
        f.get_string_array("t.arr.string").unwrap(),
        ["a", "", "ü🦀"]
    );
    assert_eq!(f.get_string_array("t.arr.u8"), None);
    assert_eq!(f.get_f32_array("t.arr.f32").unwrap(), [0.5, -0.25, 1e30]);
    assert_eq!(f.get_i32_array("t.arr.i32").unwrap(), [-7, i32::MAX]);
    assert_eq!(
        f.get_array("t.arr.empty.string").unwrap().elem_type(),
        GgufType::String
    );
    assert!(f.get_array("t.arr.empty.string").unwrap().is_empty());
    assert_eq!(
        f.get_array("t.arr.i16").unwrap().to_i64_vec(),
        Some(vec![-2, 2])
    );
    assert_eq!(f.architecture(), Some("test"));
    // Display is bounded for long arrays.
    let long: GgufValue = GgufArray::U32((0..1000).collect()).into();
    assert_eq!(long.to_string(), "[u32; 1000] [0, 1, 2, 3, 4, …]");
}

#[test]
fn streamed_output_equals_in_memory_output() {
    let (w, datas) = build(Some(64));
    let reference = w.write_to(Vec::new()).unwrap();

    // Same file, but every second tensor's bytes are streamed in 5-byte chunks.
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "test").unwrap();
    w.add_kv("general.alignment", 64u32).unwrap();
    for (k, v) in every_value() {
        w.add_kv(k, v).unwrap();
    }
    for (i, (t, data)) in tensors().into_iter().zip(&datas).enumerate() {
        if i % 2 == 0 {
            w.declare_tensor(t.name, t.qtype, t.dims).unwrap();
        } else {
            w.add_tensor(t.name, t.qtype, t.dims, data.clone()).unwrap();
        }
    }
    let mut s = w.begin(Vec::new()).unwrap();
    for (i, (t, data)) in tensors().into_iter().zip(&datas).enumerate() {
        if i % 2 == 0 && !data.is_empty() {
            assert_eq!(s.next_tensor().unwrap().0, t.name);
            for chunk in data.chunks(5) {
                s.write_tensor_data(chunk).unwrap();
            }
        }
    }
    assert!(s.next_tensor().is_none());
    assert!(matches!(
        s.write_tensor_data(&[0]),
        Err(GgufError::UnexpectedTensorData)
    ));
    let streamed = s.finish().unwrap();
    assert_eq!(streamed, reference);
}

#[test]
fn writer_rejects_bad_input() {
    let mut w = GgufWriter::new();
    w.add_kv("k", 1u32).unwrap();
    assert!(matches!(w.add_kv("k", 2u32), Err(GgufError::DuplicateKey(k)) if k == "k"));
    assert!(matches!(
        w.add_kv("general.alignment", 48u32),
        Err(GgufError::BadAlignment(48))
    ));
    assert!(matches!(
        w.add_kv("general.alignment", 0u32),
        Err(GgufError::BadAlignment(0))
    ));
    assert!(matches!(
        w.add_kv("general.alignment", -32i32),
        Err(GgufError::WrongType { .. })
    ));
    assert!(matches!(
        w.add_tensor("t", QType::F32, vec![4], vec![0; 15]),
        Err(GgufError::DataSizeMismatch {
            expected: 16,
            actual: 15,
            ..
        })
    ));
    assert!(matches!(
        w.add_tensor("t", QType::Q4_0, vec![31], vec![]),
        Err(GgufError::BadShape { .. })
    ));
    assert!(matches!(
        w.declare_tensor("t", QType::F32, vec![1; 5]),
        Err(GgufError::TooManyDims { .. })
    ));
    w.declare_tensor("t", QType::F32, vec![4]).unwrap();
    assert!(matches!(
        w.declare_tensor("t", QType::F32, vec![4]),
        Err(GgufError::DuplicateTensor(_))
    ));
    let mut deep = GgufArray::U8(vec![1]);
    for _ in 0..12 {
        deep = GgufArray::Array(vec![deep]);
    }
    assert!(matches!(
        w.add_kv("deep", deep),
        Err(GgufError::NestingTooDeep { .. })
    ));

    let mut s = w.begin(Vec::new()).unwrap();
    assert!(matches!(
        s.write_tensor_data(&[0; 20]),
        Err(GgufError::DataSizeMismatch {
            expected: 16,
            actual: 20,
            ..
        })
    ));
    s.write_tensor_data(&[0; 8]).unwrap();
    assert!(matches!(s.finish(), Err(GgufError::MissingTensorData { name }) if name == "t"));
}
