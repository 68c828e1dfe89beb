//! kiln's IQ4_NL and IQ4_XS quantisers against llama.cpp's: two rows of a real tensor
//! (the real SmolLM2's blk.10.ffn_down, dequantised from its Q4_1 file) and the bytes
//! `llama-quantize` wrote for them (no importance matrix), committed by
//! scripts/fixtures/make_iq4_fixture.py. The bytes must be identical.

use kiln_core::quant::quantize;
use kiln_core::QType;
use serde_json::Value;

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

#[test]
fn iq4_quantisers_write_llama_cpps_bytes() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/iq4_llamacpp.json"
    );
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let values: Vec<f32> = unhex(fixture["values_f32_le_hex"].as_str().unwrap())
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    for (qtype, key) in [(QType::IQ4_NL, "iq4_nl_hex"), (QType::IQ4_XS, "iq4_xs_hex")] {
        let want = unhex(fixture[key].as_str().unwrap());
        let mut got = vec![0u8; want.len()];
        quantize(qtype, &values, &mut got).unwrap();
        let first = got.iter().zip(&want).position(|(a, b)| a != b);
        assert_eq!(
            first, None,
            "{qtype}: bytes differ from llama.cpp's from byte {first:?}"
        );
    }
}
