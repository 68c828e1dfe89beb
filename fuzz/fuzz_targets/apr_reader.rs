//! Feeds arbitrary bytes to the APR v2 reader: it must return `Ok` or a typed error, never
//! panic, and never allocate without bound (libFuzzer's -rss_limit_mb catches that).
//!
//! Each input is read twice: as it is, and with both CRCs recomputed, so mutations also
//! reach the validation behind the checksums.
//!
//! Seeds: fuzz/corpus/apr_reader (regenerate with
//! `cargo test --release -p kiln-formats --test apr_container -- --ignored regenerate`).
#![no_main]

use kiln_formats::apr::{header_crc, AprFile, AprReadOptions};
use libfuzzer_sys::fuzz_target;

fn read(bytes: Vec<u8>) {
    // A small decompression limit keeps each run fast; the limit logic is the same.
    let opts = AprReadOptions { decompress_floor: 16 << 20, decompress_ratio: 64, ..AprReadOptions::default() };
    if let Ok(f) = AprFile::from_bytes_with(bytes, &opts) {
        let len = f.storage().len();
        for t in f.tensors() {
            let data = f.tensor_bytes(t);
            assert_eq!(data.len() as u64, t.size);
            assert!(f.tensor_offset(t) + data.len() <= len);
            assert_eq!(t.dtype.byte_size(t.elements()), Some(t.size));
            assert!(std::ptr::eq(f.tensor(&t.name).unwrap(), t));
        }
    }
}

fuzz_target!(|data: &[u8]| {
    read(data.to_vec());
    if data.len() >= 68 {
        let mut b = data.to_vec();
        let crc = header_crc(b[..64].try_into().unwrap());
        b[40..44].copy_from_slice(&crc.to_le_bytes());
        // A compressed payload (frame magic after the header) carries its CRC inside.
        if !matches!(&b[64..68], [0x28, 0xB5, 0x2F, 0xFD] | [0x04, 0x22, 0x4D, 0x18]) {
            let n = b.len() - 4;
            let crc = crc32fast::hash(&b[..n]);
            b[n..].copy_from_slice(&crc.to_le_bytes());
        }
        read(b);
    }
});
