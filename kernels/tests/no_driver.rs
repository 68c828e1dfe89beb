//! Runs everywhere: without a driver, opening a device is an error with a reason, never a
//! panic; with one, the same call succeeds.

#[test]
fn missing_driver_is_an_error_not_a_panic() {
    match kiln_kernels::unavailable_reason() {
        Some(why) => {
            println!("no driver: {why}");
            let err = kiln_kernels::Device::new(0).expect_err("no driver, yet a device opened");
            assert!(!err.to_string().is_empty());
        }
        None => {
            let dev = kiln_kernels::Device::new(0).expect("a driver and a device are present");
            println!("CUDA device: {dev:?}, driver {}", dev.driver_version());
        }
    }
}
