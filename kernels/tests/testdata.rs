//! Host-only checks of the test-data generators the GPU tests rely on.

use kiln_core::{QType, Rng};
use kiln_kernels::testdata::{gaussian_weights, random_weights, reference_gemv};

#[test]
fn generated_weights_dequantise_to_finite_values_of_the_intended_scale() {
    let mut rng = Rng::new(3);
    for q in kiln_kernels::gemv_qtypes() {
        let k = if q.block_len() == 256 { 512 } else { 96 };
        let mut cases = vec![(random_weights(&mut rng, q, k, 4).unwrap(), "uniform")];
        // Gaussian weights go through core's quantiser, which the 2- and 3-bit K-quants lack.
        if kiln_core::quant::can_quantize(q) {
            cases.push((
                gaussian_weights(&mut rng, q, k, 4, 0.5).unwrap(),
                "gaussian",
            ));
        }
        for (bytes, what) in cases {
            let mut v = vec![0f32; 4 * k];
            kiln_core::quant::dequantize(q, &bytes, &mut v).unwrap();
            assert!(
                v.iter().all(|x| x.is_finite()),
                "{q} {what}: non-finite value"
            );
            let rms = (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32).sqrt();
            assert!(rms > 0.05 && rms < 2.0, "{q} {what}: rms {rms}");
            if what == "gaussian" {
                assert!(
                    (rms - 0.5).abs() < 0.1,
                    "{q} gaussian: rms {rms}, expected about 0.5"
                );
            }
        }
    }
    // The reference product is a plain dot product of the dequantised rows.
    let w = gaussian_weights(&mut rng, QType::Q8_0, 64, 2, 1.0).unwrap();
    let mut deq = vec![0f32; 128];
    kiln_core::quant::dequantize(QType::Q8_0, &w, &mut deq).unwrap();
    let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.1).sin()).collect();
    let y = reference_gemv(QType::Q8_0, 64, 2, &w, &x).unwrap();
    let direct: f64 = deq[64..]
        .iter()
        .zip(&x)
        .map(|(&a, &b)| a as f64 * b as f64)
        .sum();
    assert!((y[1] - direct).abs() < 1e-9);
}
