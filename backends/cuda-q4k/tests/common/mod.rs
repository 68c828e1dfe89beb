//! What the GPU tests of this crate share: the device, and the small random models of each
//! architecture shape (weights drawn Gaussian and quantised by the reference quantisers)
//! with the cosine they are compared by — the same models the conformance suite runs
//! (`kiln_conformance::models`).

#![allow(dead_code)] // each test binary uses its own subset

use std::sync::Arc;

#[allow(unused_imports)] // each test binary uses its own subset
pub use kiln_conformance::models::{cosine, model, shapes, Shape};
use kiln_kernels::Device;

pub fn device() -> Option<Arc<Device>> {
    match kiln_kernels::unavailable_reason() {
        Some(why) => {
            kiln_kernels::testdata::skip(&why);
            None
        }
        None => Some(Device::new(0).expect("a driver and a device are present")),
    }
}
