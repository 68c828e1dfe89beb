//! Micro-benchmarks of the decode kernels on the GPU present: the device-to-device copy
//! roofline, every GEMV type at real model shapes on every activation path and every
//! rows-per-warp choice (with its error against the f64 reference), RMSNorm+Q8_1 and
//! attention; with `--bmm`, only the batched decode matmuls instead (8 to 64 rows at the 8B
//! shapes: time per launch, weight bandwidth and int8 rate; `--bmm --once` launches each
//! once and times nothing, for a profiler; `--attention`: only the attention kernels, one
//! sequence's and the batched step's two). Timings are CUDA-event medians over graph
//! replays of several launches that rotate through enough weight copies to defeat the L2
//! cache.
//!
//! `cargo run --release -p kiln-kernels --example kernel_bench [-- --quick] [--formats q4_0,q4_0x4] [--all-shapes] [--bmm [--once]] [--attention]`
//! (`--formats` picks weight formats by tag; `--all-shapes` keeps every shape with --quick).

use std::sync::Arc;

use kiln_core::{QType, Rng};
use kiln_kernels::testdata::{fresh_seed, random_vec, random_weights, reference_gemv, rel_err};
use kiln_kernels::{
    AttnArgs, AttnHeads, BatchEpilogue, BmmPath, Device, DeviceBuffer, DeviceWeight, Epilogue,
    Event, GemvInput, GemvPath, GemvTiling, Graph, Kernels, KvCache, KvFormat, PackedActBuffers,
    PackedWeight, QuantBuffers, QuantOut, Result, WeightFormat, FORMATS,
};

const LAUNCHES_PER_GRAPH: usize = 20;
const PATHS: [GemvPath; 3] = [GemvPath::Float, GemvPath::Q8, GemvPath::Q16];
const ROUNDS: usize = 9;

/// Median milliseconds of one launch of what `body` queues.
fn time_graph(dev: &Arc<Device>, graph: &Graph, launches: usize) -> Result<f64> {
    for _ in 0..3 {
        graph.launch()?;
    }
    let (a, b) = (Event::new(dev)?, Event::new(dev)?);
    let mut v = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        a.record()?;
        graph.launch()?;
        b.record()?;
        v.push(a.elapsed_ms(&b)? as f64 / launches as f64);
    }
    v.sort_by(|x, y| x.total_cmp(y));
    Ok(v[ROUNDS / 2])
}

struct Row {
    what: String,
    us: f64,
    gbps: f64,
    err: Option<f64>,
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let all_shapes = args.iter().any(|a| a == "--all-shapes");
    let only: Option<Vec<String>> = args
        .iter()
        .position(|a| a == "--formats")
        .and_then(|i| args.get(i + 1))
        .map(|v| v.split(',').map(str::to_string).collect());
    let dev = match Device::new(0) {
        Ok(d) => d,
        Err(e) => {
            println!("skipped: {e}");
            return Ok(());
        }
    };
    let k = Kernels::new(&dev);
    let t0 = std::time::Instant::now();
    // The partial runs compile only the modules they launch (on first use).
    let partial = args.iter().any(|a| a == "--bmm" || a == "--attention");
    if !partial {
        k.preload()?;
    }
    println!(
        "device: {} sm_{}{} {} SMs {:.1} GiB, driver {}; kernels compiled/loaded in {:.1}s",
        dev.name(),
        dev.arch().0,
        dev.arch().1,
        dev.sm_count(),
        dev.total_memory() as f64 / (1u64 << 30) as f64,
        dev.driver_version(),
        t0.elapsed().as_secs_f64()
    );
    let seed = fresh_seed();
    println!("seed {seed}");
    let mut rng = Rng::new(seed);

    let roofline = kiln_kernels::roofline::copy_bandwidth_gbs(&dev, &k)?;
    println!("copy roofline: {roofline:.0} GB/s (1 GiB copies, bytes read + written)");
    if args.iter().any(|a| a == "--bmm") {
        let once = args.iter().any(|a| a == "--once");
        if args.iter().any(|a| a == "--sweep") {
            return pipeline_sweep(&dev, &k, &mut rng, roofline);
        }
        return batched_matmuls(&dev, &k, &mut rng, roofline, only.as_deref(), once);
    }

    // (row length K, rows N, label)
    let mut shapes = vec![
        (4096, 4096, "8B attn 4096x4096"),
        (576, 1536, "135M gate/up 1536x576"),
        (1536, 576, "135M down 576x1536"),
        (4096, 14336, "8B gate/up 14336x4096"),
        (14336, 4096, "8B down 4096x14336"),
        (2048, 8192, "1B gate/up 8192x2048"),
        (8192, 2048, "1B down 2048x8192"),
    ];
    if quick && !all_shapes {
        shapes.truncate(3);
    }
    let attention_only = args.iter().any(|a| a == "--attention");
    if attention_only {
        shapes.clear();
    }
    let mut rows: Vec<Row> = Vec::new();
    let mut best: Vec<(String, &str, [Option<Row>; 3])> = Vec::new();
    for &(kk, n, label) in &shapes {
        let x = random_vec(&mut rng, kk, 1.0);
        let xd = DeviceBuffer::from_host(&dev, &x)?;
        let nblk = kk.div_ceil(32);
        let xq = QuantBuffers::alloc(&dev, kk)?;
        let q8 = xq.act();
        k.rmsnorm_q8_1(xd.slice(), 1, kk, None, None, None, Some(q8))?;
        let input = GemvInput {
            x: Some(xd.slice()),
            q8: Some(q8),
            norm: None,
        };
        let y = DeviceBuffer::<f32>::alloc(&dev, n)?;
        // The quantising GEMVs' output planes.
        let yq = QuantBuffers::alloc(&dev, n)?;
        let quantising = Epilogue {
            quant: Some(QuantOut {
                q: yq.act(),
                norm_w: None,
                norm_parts: None,
            }),
            ..Default::default()
        };
        for f in &FORMATS {
            let q = f.qtype;
            if !kk.is_multiple_of(q.block_len())
                || only.as_ref().is_some_and(|o| !o.iter().any(|t| t == f.tag))
            {
                continue;
            }
            let ggml = random_weights(&mut rng, q, kk, n)?;
            let packed = PackedWeight::pack_as(f, kk, n, &ggml)?;
            // Enough copies that the rotation streams at least 512 MB (L2 is 60 MB).
            let copies = (512usize << 20).div_ceil(packed.bytes()).clamp(2, 16);
            let ws: Vec<DeviceWeight> = (0..copies)
                .map(|_| DeviceWeight::upload(&dev, &packed))
                .collect::<Result<_>>()?;
            let reference = if kk * n <= 4096 * 4096 {
                Some(reference_gemv(q, kk, n, &ggml, &x)?)
            } else {
                None
            };
            // Fastest tiling per path: Float, Q8, Q16.
            let mut fastest: [Option<Row>; 3] = [None, None, None];
            for (pi, path) in PATHS.into_iter().enumerate() {
                if path != GemvPath::Float && !q.is_quantized() {
                    continue;
                }
                // Plain tilings, then (integer paths) the quantising ones, marked "q".
                let plain = GemvTiling::all().map(|t| (t, false));
                let quant = GemvTiling::quantising()
                    .filter(|_| path != GemvPath::Float)
                    .map(|t| (t, true));
                for (t, quantise) in plain
                    .chain(quant)
                    .filter(|(t, _)| t.rows_per_warp.is_multiple_of(f.row_group))
                {
                    let epi = if quantise {
                        quantising
                    } else {
                        Epilogue::default()
                    };
                    let g = dev.capture(|| {
                        for i in 0..LAUNCHES_PER_GRAPH {
                            k.gemv(&ws[i % copies], &input, path, t, y.slice(), &epi)?;
                        }
                        Ok(())
                    })?;
                    let ms = time_graph(&dev, &g, LAUNCHES_PER_GRAPH)?;
                    let x_bytes = match path {
                        GemvPath::Float => kk * 4,
                        GemvPath::Q8 => nblk * 40,
                        GemvPath::Q16 => nblk * 72,
                    };
                    let bytes = packed.bytes() + x_bytes + n * 4;
                    let err = match &reference {
                        Some(reference) => {
                            y.fill_bytes(0xff)?;
                            k.gemv(&ws[0], &input, path, t, y.slice(), &epi)?;
                            Some(rel_err(&y.to_host()?, reference))
                        }
                        None => None,
                    };
                    let row = Row {
                        what: format!(
                            "{label:<24} {:<6} {:<5} R{}S{}{}",
                            f.tag,
                            format!("{path:?}"),
                            t.rows_per_warp,
                            t.warps_per_row,
                            if quantise { "q" } else { "" }
                        ),
                        us: ms * 1e3,
                        gbps: bytes as f64 / (ms * 1e-3) / 1e9,
                        err,
                    };
                    let slot = &mut fastest[pi];
                    if slot.as_ref().is_none_or(|b| row.us < b.us) {
                        *slot = Some(Row {
                            what: row.what.clone(),
                            ..row
                        });
                    }
                    rows.push(row);
                }
            }
            // Gate/up shapes: the fused SwiGLU (two weights of this shape, output quantised)
            // as a decode step runs it, on the integer paths.
            if label.contains("gate/up") && q.is_quantized() {
                for path in [GemvPath::Q8, GemvPath::Q16] {
                    for t in GemvTiling::quantising()
                        .filter(|t| t.rows_per_warp.is_multiple_of(f.row_group))
                    {
                        let g = dev.capture(|| {
                            for i in 0..LAUNCHES_PER_GRAPH {
                                let (gate, up) = (&ws[(2 * i) % copies], &ws[(2 * i + 1) % copies]);
                                k.swiglu(
                                    gate,
                                    up,
                                    &input,
                                    path,
                                    t,
                                    y.slice(),
                                    quantising.quant,
                                    kiln_kernels::GatedAct::Silu,
                                )?;
                            }
                            Ok(())
                        })?;
                        let ms = time_graph(&dev, &g, LAUNCHES_PER_GRAPH)?;
                        let bytes = 2 * packed.bytes() + nblk * 72 + n * 4;
                        rows.push(Row {
                            what: format!(
                                "{label:<24} {:<6} {:<5} R{}S{}q swiglu",
                                f.tag,
                                format!("{path:?}"),
                                t.rows_per_warp,
                                t.warps_per_row
                            ),
                            us: ms * 1e3,
                            gbps: bytes as f64 / (ms * 1e-3) / 1e9,
                            err: None,
                        });
                    }
                }
            }
            best.push((label.to_string(), f.tag, fastest));
        }
    }
    println!("\nall GEMV configurations (time per launch, bytes = weights + activation + output):");
    for r in &rows {
        println!(
            "  {}  {:>8.2} us  {:>6.0} GB/s  {:>5.1}%  err {}",
            r.what,
            r.us,
            r.gbps,
            100.0 * r.gbps / roofline,
            r.err.map_or("-".into(), |e| format!("{e:.1e}"))
        );
    }

    // RMSNorm + Q8_1 and attention, 8B shapes.
    let mut extra = Vec::new();
    for kk in [576usize, 2048, 4096, 14336]
        .into_iter()
        .filter(|_| !attention_only)
    {
        let x = DeviceBuffer::from_host(&dev, &random_vec(&mut rng, kk, 1.0))?;
        let w = DeviceBuffer::from_host(&dev, &random_vec(&mut rng, kk, 1.0))?;
        let yv = DeviceBuffer::<f32>::alloc(&dev, kk)?;
        let xq = QuantBuffers::alloc(&dev, kk)?;
        let q8 = xq.act();
        let g = dev.capture(|| {
            for _ in 0..LAUNCHES_PER_GRAPH {
                k.rmsnorm_q8_1(
                    x.slice(),
                    1,
                    kk,
                    Some(w.slice()),
                    Some(1e-5),
                    Some(yv.slice()),
                    Some(q8),
                )?;
            }
            Ok(())
        })?;
        extra.push(format!(
            "rmsnorm+q8_1 n={kk}: {:.2} us",
            time_graph(&dev, &g, LAUNCHES_PER_GRAPH)? * 1e3
        ));
    }
    let (n_heads, n_kv, hd, max_ctx) = (32usize, 8usize, 128usize, 8192usize);
    for (format, split) in [
        (KvFormat::F16, 64usize),
        (KvFormat::F16, 256),
        (KvFormat::Q8_0, 256),
    ] {
        let cache = KvCache::with_format(&dev, format, 1, n_kv, hd, &[max_ctx])?;
        let kv = cache.layer(0, 0)?;
        let n = kv.values();
        fill_f16_planes(&dev, &kv, &mut rng)?;
        if let Some(p) = kv.as_q8_0() {
            for (q, d) in [(p.k, p.k_scales), (p.v, p.v_scales)] {
                let qs: Vec<i8> = (0..n).map(|_| (rng.next_u64() % 255) as i8).collect();
                let ds = vec![half::f16::from_f32(0.004).to_bits(); n / 32];
                q.copy_from_host(&dev, &qs)?;
                d.copy_from_host(&dev, &ds)?;
            }
        }
        let qd = DeviceBuffer::from_host(&dev, &random_vec(&mut rng, n_heads * hd, 1.0))?;
        let nsplit = Kernels::attention_splits(max_ctx, split);
        let part_o = DeviceBuffer::<f32>::alloc(&dev, n_heads * nsplit * hd)?;
        let part_ml = DeviceBuffer::<[f32; 2]>::alloc(&dev, n_heads * nsplit)?;
        let out = DeviceBuffer::<f32>::alloc(&dev, n_heads * hd)?;
        let counters = DeviceBuffer::<u32>::zeros(&dev, n_heads)?;
        for len in [128usize, 1024, 4096, 8192] {
            let lend = DeviceBuffer::from_host(&dev, &[len as i32])?;
            let a = AttnArgs {
                sinks: None,
                n_heads,
                n_kv,
                head_dim: hd,
                max_ctx,
                split,
                scale: 1.0 / (hd as f32).sqrt(),
                window: 0,
                heads: AttnHeads::One,
                splits: 0,
            };
            let g = dev.capture(|| {
                for _ in 0..LAUNCHES_PER_GRAPH {
                    k.attention(
                        &a,
                        qd.slice(),
                        kv,
                        lend.slice(),
                        part_o.slice(),
                        part_ml.slice(),
                        counters.slice(),
                        out.slice(),
                        None,
                    )?;
                }
                Ok(())
            })?;
            let ms = time_graph(&dev, &g, LAUNCHES_PER_GRAPH)?;
            let bytes = 2 * format.bytes(len * n_kv * hd);
            extra.push(format!(
            "attention 8B (32/8 heads, hd 128) {format:?} KV ctx {len} split {split}: {:.2} us, {:.0} GB/s of KV",
            ms * 1e3,
            bytes as f64 / (ms * 1e-3) / 1e9
        ));
        }
    }
    for e in &extra {
        println!("{e}");
    }
    if attention_only {
        batched_attention(&dev, &k, &mut rng)?;
    }

    println!("\nsummary: fastest tiling per path (time, % of the copy roofline {roofline:.0} GB/s, rel. error)");
    println!("| shape | type | Float | Q8 | Q16 |");
    println!("|---|---|---|---|---|");
    for (label, q, fastest) in &best {
        let cell = |r: &Option<Row>| match r {
            None => "-".to_string(),
            Some(r) => format!(
                "{:.2} us {} {:.0}% {}",
                r.us,
                r.what.split_whitespace().last().unwrap_or(""),
                100.0 * r.gbps / roofline,
                r.err.map_or("".to_string(), |e| format!("{e:.1e}"))
            ),
        };
        println!(
            "| {label} | {} | {} | {} | {} |",
            q,
            cell(&fastest[0]),
            cell(&fastest[1]),
            cell(&fastest[2])
        );
    }
    Ok(())
}

/// One batched-matmul shape at the 8B's sizes: copies of one random weight (SwiGLU: pairs)
/// rotated through ≥ 512 MB so that L2 holds none of a launch's weights.
struct BmmShape {
    ws: Vec<DeviceWeight>,
    /// Weight bytes one launch reads.
    per_launch: usize,
    kk: usize,
    n: usize,
    swiglu: bool,
}

impl BmmShape {
    fn new(
        dev: &Arc<Device>,
        rng: &mut Rng,
        f: &'static WeightFormat,
        kk: usize,
        n: usize,
        swiglu: bool,
    ) -> Result<Self> {
        let packed = PackedWeight::pack_as(f, kk, n, &random_weights(rng, f.qtype, kk, n)?)?;
        let per_launch = packed.bytes() * if swiglu { 2 } else { 1 };
        let copies = (512usize << 20).div_ceil(per_launch).clamp(2, 16) * 2;
        let ws = (0..copies)
            .map(|_| DeviceWeight::upload(dev, &packed))
            .collect::<Result<_>>()?;
        Ok(BmmShape {
            ws,
            per_launch,
            kk,
            n,
            swiglu,
        })
    }

    /// `rows` random rows packed for the matmuls, and an output for them.
    fn input(
        &self,
        dev: &Arc<Device>,
        k: &Kernels,
        rng: &mut Rng,
        rows: usize,
    ) -> Result<(PackedActBuffers, DeviceBuffer<f32>)> {
        let x = DeviceBuffer::from_host(dev, &random_vec(rng, rows * self.kk, 1.0))?;
        let packed = PackedActBuffers::alloc(dev, rows, self.kk)?;
        k.act_pack(x.slice(), rows, self.kk, None, None, packed.view())?;
        Ok((packed, DeviceBuffer::<f32>::alloc(dev, rows * self.n)?))
    }

    /// Milliseconds per launch over `rows` rows with the kernels' current settings: a graph
    /// of LAUNCHES_PER_GRAPH launches walking the copies, or (`once`) one launch outside
    /// any graph, for a profiler (then 0).
    fn time(
        &self,
        dev: &Arc<Device>,
        k: &Kernels,
        act: &PackedActBuffers,
        y: &DeviceBuffer<f32>,
        rows: usize,
        once: bool,
    ) -> Result<f64> {
        let part = DeviceBuffer::<f32>::alloc(dev, k.bmm_part_len(&self.ws[0], rows, self.swiglu))?;
        let epi = BatchEpilogue::default();
        let copies = self.ws.len();
        let launch = |i: usize| {
            let (w, up) = if self.swiglu {
                (
                    &self.ws[(2 * i) % copies],
                    Some(&self.ws[(2 * i + 1) % copies]),
                )
            } else {
                (&self.ws[i % copies], None)
            };
            k.batched_matmul(
                w,
                up,
                &act.view(),
                rows,
                part.slice(),
                y.slice(),
                self.n,
                &epi,
            )
        };
        if once {
            launch(0)?;
            dev.synchronize()?;
            return Ok(0.0);
        }
        let g = dev.capture(|| (0..LAUNCHES_PER_GRAPH).try_for_each(launch))?;
        time_graph(dev, &g, LAUNCHES_PER_GRAPH)
    }
}

/// (K, N, label, SwiGLU: gate and up of this shape in one launch)
const BMM_SHAPES: [(usize, usize, &str, bool); 3] = [
    (4096, 4096, "8B q/o 4096x4096", false),
    (4096, 14336, "8B gate/up 14336x4096", true),
    (14336, 4096, "8B down 4096x14336", false),
];

/// The f16 pipelined walk at the 8B's q4_k shapes and q6_k's down for each depth (2–4
/// stages) and split target (1, 2, 4 blocks per SM): µs per launch.
fn pipeline_sweep(dev: &Arc<Device>, k: &Kernels, rng: &mut Rng, roofline: f64) -> Result<()> {
    println!("\nf16 pipelined walk: stages x blocks per SM (µs per launch incl. the split sum)");
    println!("| shape | type | rows | stages | blocks/SM | us | % roofline |");
    println!("|---|---|---:|---:|---:|---:|---:|");
    k.set_bmm_path(BmmPath::PipelinedF16);
    for f in FORMATS
        .iter()
        .filter(|f| f.tag == "q4_k" || f.tag == "q6_k")
    {
        for &(kk, n, label, swiglu) in &BMM_SHAPES {
            if f.qtype == QType::Q6_K && kk != 14336 {
                continue;
            }
            let shape = BmmShape::new(dev, rng, f, kk, n, swiglu)?;
            for rows in [8usize, 16, 32, 64] {
                let (act, y) = shape.input(dev, k, rng, rows)?;
                for stages in [2usize, 3, 4] {
                    for bps in [1usize, 2, 4] {
                        k.set_bmm_pipeline(stages, bps);
                        let ms = shape.time(dev, k, &act, &y, rows, false)?;
                        let gbps = shape.per_launch as f64 / (ms * 1e-3) / 1e9;
                        println!(
                            "| {label} | {} | {rows} | {stages} | {bps} | {:.1} | {:.0}% |",
                            f.tag,
                            ms * 1e3,
                            100.0 * gbps / roofline
                        );
                    }
                }
            }
        }
    }
    k.set_bmm_pipeline(2, 2);
    Ok(())
}

/// The batched decode matmuls (`Kernels::batched_matmul`: the mma kernel and its split-sum
/// epilogue) at the 8B shapes for 8 to 64 rows, every path a format has: time per launch,
/// the weights' bandwidth against the copy roofline and the rate (2 · rows · K · N per
/// launch, TOPS).
fn batched_matmuls(
    dev: &Arc<Device>,
    k: &Kernels,
    rng: &mut Rng,
    roofline: f64,
    only: Option<&[String]>,
    once: bool,
) -> Result<()> {
    let default = ["q4_k", "q6_k", "q4_0"].map(str::to_string);
    let tags = only.unwrap_or(&default);
    println!("\nbatched matmuls (time per launch incl. the split sum; GB/s of weights; TOPS)");
    println!("| shape | type | walk | rows | us | GB/s | % roofline | TOPS |");
    println!("|---|---|---|---:|---:|---:|---:|---:|");
    for f in FORMATS
        .iter()
        .filter(|f| f.batched.is_some() && tags.iter().any(|t| t == f.tag))
    {
        for &(kk, n, label, swiglu) in &BMM_SHAPES {
            let shape = BmmShape::new(dev, rng, f, kk, n, swiglu)?;
            for rows in [8usize, 16, 32, 64] {
                let (act, y) = shape.input(dev, k, rng, rows)?;
                // The K-quants' two paths; the register walk every format has.
                let paths: &[BmmPath] =
                    if matches!(f.qtype, QType::Q4_K | QType::Q5_K | QType::Q6_K) {
                        &[BmmPath::PipelinedF16, BmmPath::Registers]
                    } else {
                        &[BmmPath::Registers]
                    };
                for &path in paths {
                    k.set_bmm_path(path);
                    let ms = shape.time(dev, k, &act, &y, rows, once)?;
                    if once {
                        continue;
                    }
                    let gbps = shape.per_launch as f64 / (ms * 1e-3) / 1e9;
                    let ops = 2.0 * (rows * kk * n) as f64 * if swiglu { 2.0 } else { 1.0 };
                    println!(
                        "| {label} | {} | {path:?} | {rows} | {:.1} | {gbps:.0} | {:.0}% | {:.1} |",
                        f.tag,
                        ms * 1e3,
                        100.0 * gbps / roofline,
                        ops / (ms * 1e-3) / 1e12
                    );
                }
                k.set_bmm_path(BmmPath::PipelinedF16);
            }
        }
    }
    Ok(())
}

/// The batched step's decode attention at the 8B's heads (32 query heads, 8 KV heads of 128
/// values) and the 1B's (32 / 8 of 64), f16 cache: 1, 4, 16 and 64 rows, every row at the
/// same context (one row out to 32,768 positions, at the one-sequence step's least split),
/// both kernels (`BatchAttention`: a head a block, paired from 16 rows as the executor
/// pairs them, and a GQA group a block on tensor cores): time per launch and GB/s of K/V
/// read once.
fn batched_attention(dev: &Arc<Device>, k: &Kernels, rng: &mut Rng) -> Result<()> {
    use kiln_kernels::{BatchAttention, BatchRows};
    println!("\nbatched decode attention, f16 cache (time per launch; GB/s of K/V)");
    println!("| heads | rows | context | heads a block | GB/s | group on tensor cores | GB/s |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for (label, n_heads, n_kv, hd) in [("8B", 32usize, 8usize, 128usize), ("1B", 32, 8, 64)] {
        for rows in [1usize, 4, 16, 64] {
            let (max_ctx, split, lens): (usize, usize, &[usize]) = match rows {
                1 => (32_768, 64, &[130, 1024, 4096, 16_384, 32_768]),
                _ => (4352, 128, &[130, 1024, 4096]),
            };
            // One row's launches go through 16 layers' caches in turn, as a step's do, so
            // that a cache is not still in L2 when its next launch reads it.
            let layers = if rows == 1 { 16 } else { 1 };
            let cache =
                KvCache::with_format(dev, KvFormat::F16, rows, n_kv, hd, &vec![max_ctx; layers])?;
            let kvs = (0..layers)
                .map(|l| cache.layer_all(l))
                .collect::<kiln_kernels::Result<Vec<_>>>()?;
            for kv in &kvs {
                fill_f16_planes(dev, kv, rng)?;
            }
            let qd = n_heads * hd;
            let q = DeviceBuffer::from_host(dev, &random_vec(rng, rows * qd, 1.0))?;
            let a = AttnArgs {
                sinks: None,
                n_heads,
                n_kv,
                head_dim: hd,
                max_ctx,
                split,
                scale: 1.0 / (hd as f32).sqrt(),
                window: 0,
                heads: if rows >= 16 {
                    AttnHeads::Pairs
                } else {
                    AttnHeads::One
                },
                splits: 0,
            };
            let nsplit = a.grid_splits();
            let part_o = DeviceBuffer::<f32>::alloc(dev, rows * qd * nsplit)?;
            let part_ml = DeviceBuffer::<[f32; 2]>::alloc(dev, rows * n_heads * nsplit)?;
            let counters = DeviceBuffer::<u32>::zeros(dev, rows * n_heads)?;
            let out = DeviceBuffer::<f32>::alloc(dev, rows * qd)?;
            let slot: Vec<i32> = (0..rows as i32).collect();
            let slotd = DeviceBuffer::from_host(dev, &slot)?;
            for &len in lens {
                let pos = DeviceBuffer::from_host(dev, &vec![len as i32 - 1; rows])?;
                let lensd = DeviceBuffer::from_host(dev, &vec![len as i32; rows])?;
                let b = BatchRows {
                    rows,
                    pos: pos.slice(),
                    len: lensd.slice(),
                    slot: slotd.slice(),
                };
                let mut us = [0f64; 2];
                for (i, kind) in [BatchAttention::Heads, BatchAttention::GroupMma]
                    .into_iter()
                    .enumerate()
                {
                    k.set_batch_attention(kind);
                    let g = dev.capture(|| {
                        for l in 0..LAUNCHES_PER_GRAPH {
                            k.attention_batch(
                                &a,
                                q.slice(),
                                kvs[l % layers],
                                cache.slot_stride(0),
                                &b,
                                part_o.slice(),
                                part_ml.slice(),
                                counters.slice(),
                                out.slice(),
                                None,
                            )?;
                        }
                        Ok(())
                    });
                    k.set_batch_attention(BatchAttention::Auto);
                    us[i] = time_graph(dev, &g?, LAUNCHES_PER_GRAPH)? * 1e3;
                }
                let gbps = |us: f64| (2 * rows * len * n_kv * hd * 2) as f64 / (us * 1e-6) / 1e9;
                println!(
                    "| {label} | {rows} | {len} | {:.2} us | {:.0} | {:.2} us | {:.0} |",
                    us[0],
                    gbps(us[0]),
                    us[1],
                    gbps(us[1])
                );
            }
        }
    }
    Ok(())
}

/// Random keys and values in [-0.5, 0.5) for an f16 cache's planes (a q8_0 cache is left
/// as it is).
fn fill_f16_planes(dev: &Arc<Device>, kv: &kiln_kernels::KvPlanes, rng: &mut Rng) -> Result<()> {
    if let Some((kc, vc)) = kv.as_f16() {
        for plane in [kc, vc] {
            let h: Vec<u16> = (0..kv.values())
                .map(|_| half::f16::from_f32(rng.next_f32() - 0.5).to_bits())
                .collect();
            plane.copy_from_host(dev, &h)?;
        }
    }
    Ok(())
}
