//! The device's memory roofline: what a plain copy kernel reaches, the yardstick every
//! bandwidth-bound kernel (GEMV, a decode step) is compared with.

use std::sync::Arc;

use crate::buffer::DeviceBuffer;
use crate::device::{Device, Event};
use crate::error::Result;
use crate::ops::Kernels;

/// Copy bandwidth in GB/s (bytes read + bytes written per second): four 1 GiB copies
/// captured as one graph, replayed after a warm-up, median of 9 timed replays.
pub fn copy_bandwidth_gbs(dev: &Arc<Device>, k: &Kernels) -> Result<f64> {
    const SIZE: usize = 1 << 30;
    const COPIES: usize = 4;
    const ROUNDS: usize = 9;
    let src = DeviceBuffer::<u8>::alloc(dev, SIZE)?;
    let dst = DeviceBuffer::<u8>::alloc(dev, SIZE)?;
    src.fill_bytes(0x5a)?;
    let graph = dev.capture(|| {
        for _ in 0..COPIES {
            k.copy(src.slice(), dst.slice())?;
        }
        Ok(())
    })?;
    for _ in 0..3 {
        graph.launch()?;
    }
    let (start, end) = (Event::new(dev)?, Event::new(dev)?);
    let mut ms = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        start.record()?;
        graph.launch()?;
        end.record()?;
        ms.push(start.elapsed_ms(&end)? as f64 / COPIES as f64);
    }
    ms.sort_by(|a, b| a.total_cmp(b));
    Ok(2.0 * SIZE as f64 / (ms[ROUNDS / 2] * 1e-3) / 1e9)
}
