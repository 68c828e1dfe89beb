use kiln_kernels::compile::compile_uncached;
#[test]
fn quick() {
    let mut ms = vec![];
    for f in &kiln_kernels::FORMATS {
        if [
            "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m",
        ]
        .contains(&f.tag)
        {
            ms.extend(f.batched);
            ms.push(f.embed);
            ms.push(f.dequant);
            ms.push(f.gemv.q16[1]);
        }
    }
    for m in ms {
        let t = std::time::Instant::now();
        let c = compile_uncached(&m, (9, 0)).unwrap_or_else(|e| panic!("{e}"));
        println!(
            "{} {} bytes {:.1}s",
            m.name,
            c.len(),
            t.elapsed().as_secs_f64()
        );
    }
}
