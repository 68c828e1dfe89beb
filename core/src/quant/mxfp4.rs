//! MXFP4 (ggml type 39, the OCP microscaling format gpt-oss ships its experts in): blocks of
//! 32 values, one E8M0 exponent byte `e`, then 16 bytes of 4-bit E2M1 codes — value `j`
//! the low nibble of byte `j`, value `j + 16` its high nibble. A code is an index into
//! [`KVALUES`] (the E2M1 values doubled, so they are integers) and the block's scale is
//! half of 2^(e − 127) ([`e8m0_half`]): x = e8m0_half(e) · KVALUES[code].

/// Values in a block.
pub const QK: usize = 32;

/// The E2M1 values doubled: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (code 8 is −0).
pub const KVALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Half of the E8M0 scale 2^(e − 127), exactly (ggml's `GGML_E8M0_TO_FP32_HALF`): e = 0
/// and 1 are subnormal f32s.
pub fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        (e as u32 - 1) << 23
    };
    f32::from_bits(bits)
}

/// One block's 32 values.
pub fn dequantize_mxfp4(b: &[u8; 17], y: &mut [f32; QK]) {
    let d = e8m0_half(b[0]);
    for j in 0..QK / 2 {
        let q = b[1 + j];
        y[j] = d * KVALUES[(q & 0x0F) as usize] as f32;
        y[j + QK / 2] = d * KVALUES[(q >> 4) as usize] as f32;
    }
}

/// ggml's reference quantiser (`quantize_row_mxfp4_ref`): the exponent from the block's
/// largest magnitude, floor(log2 amax) − 2 + 127 (0 for a block of zeros), so the largest
/// code (6) reaches it; each value takes the nearest code (the first of equals).
pub fn quantize_mxfp4(x: &[f32; QK], b: &mut [u8; 17]) {
    let amax = x.iter().fold(0.0f32, |m, &v| m.max(v.abs()));
    let e = if amax > 0.0 {
        (amax.log2().floor() - 2.0 + 127.0).clamp(0.0, 255.0) as u8
    } else {
        0
    };
    let d = e8m0_half(e);
    let nearest = |v: f32| -> u8 {
        let mut best = 0;
        let mut best_err = f32::INFINITY;
        for (i, &k) in KVALUES.iter().enumerate() {
            let err = (d * k as f32 - v).abs();
            if err < best_err {
                best_err = err;
                best = i as u8;
            }
        }
        best
    };
    b[0] = e;
    for j in 0..QK / 2 {
        b[1 + j] = nearest(x[j]) | (nearest(x[j + QK / 2]) << 4);
    }
}
