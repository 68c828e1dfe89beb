//! Batched decode against one sequence at a time, on the same backend: M sequences with
//! mixed context lengths (one at 5 tokens, one at 1,500, the rest between) decode in one
//! batch per step, and each must match its own unbatched run — per-step logits cosine ≥
//! 0.99999 and the same greedy token except at near-ties (top-1/top-2 gap < 1e-3, counted
//! and printed). Where a row falls under the cosine bar, the CPU oracle decides which of
//! the two is off: the row passes only if the batched logits are within the bar of the
//! oracle's and at least as close to them as the one-sequence logits are (the two GPU
//! paths round activations differently — 15-bit blocks in the GEMVs, f16 in cuda-q4k's
//! batched K-quant matmuls — and on the real SmolLM2 the one-sequence path is the one that
//! strays: row 3 of M=16, cosine 0.9999877 between them, 0.9999992 batched-to-oracle,
//! 0.9999910 one-sequence-to-oracle, on an H100 and an H200 alike). A wrong row, position
//! or sequence is far from the oracle too, and still fails. A Mixture-of-Experts row may
//! also fall under the bar by its routing slack (`kiln_tests::RoutingSlack`: 1e-3 for each
//! layer whose router was at a near-tie for the token in the oracle): the batched path's
//! 8-bit matmul inputs can pick other experts there than the one-sequence path does. Two executors of the same model run side by side: one decodes each
//! sequence alone, the other the whole batch; both are fed the unbatched run's greedy
//! tokens (teacher forcing), so every step's logits are compared. Seeded sampling through
//! `decode_sample` (with logit biases on most rows) must draw on the device the tokens the
//! host sampler draws from the same batched logits.
//!
//! The CPU case runs in CI (a small synthetic model); the GPU cases are `#[ignore]`d like
//! every GPU test and run by scripts/gpu/gpu_suite.sh with `--include-ignored`.

use std::sync::Arc;

use kiln::conformance::top_gap;
use kiln::Model;
use kiln_core::{
    argmax, Backend, DecodeItem, LayerExecutor, LoadOptions, ModelIr, Sampler, SamplingParams,
    SeqId,
};
use kiln_formats::quantize::{no_progress, quantize_file, QuantizeOptions, Recipe};
use kiln_formats::synth::{synth_file, Preset, SynthOptions};
use kiln_kernels::WeightFormat;
use kiln_tests::{cosine, skip};

const MIN_COSINE: f64 = 0.99999;
/// Greedy picks may differ only where the one-at-a-time logits' top two are closer than
/// this: 1e-3 where both paths round alike (the CPU; the GPUs' int8 batched matmuls, which
/// take the 15-bit activations the one-sequence GEMVs take).
const TIE_GAP: f32 = 1e-3;

/// The near-tie bar of a batched decode of `ir` against its one-sequence decode. The GPUs'
/// batched matmuls over the formats with a pipelined walk (Q4_K, Q5_K, Q6_K) round weights and activations to f16
/// (as the prefill's cuBLAS GEMMs do; llama.cpp's batched matmuls take 8-bit activations)
/// where the one-sequence GEMVs take 15-bit activations: with such matrices in the blocks,
/// picks were seen flipping at top-2 gaps of 1.1e-3 and 5.3e-3 (synthetic llama3.2-1b
/// q4_k_m on cuda-q4k; 2.2e-3 for the IQ4_NL mix, whose attn_v and first ffn_down are Q5_K,
/// on cuda-q4_0; cosine ≥ 0.999995 throughout), so such models take the K-quant bar against
/// the CPU oracle (gpu_parity: 0.05). A wrong row, position or sequence fails the cosine
/// bar, which stays the same for every model.
fn tie_gap(ir: &ModelIr) -> f32 {
    let f16_walk =
        ir.matmul_share(|q| WeightFormat::plain(q).is_some_and(WeightFormat::has_pipelined_bmm));
    if f16_walk > 0.0 {
        0.05
    } else {
        TIE_GAP
    }
}

fn scratch_dir(what: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-batched-{}-{what}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn backend(name: &str) -> Option<Arc<dyn Backend>> {
    kiln::link_builtin_backends();
    let registry = kiln_core::Registry::with_builtins();
    let b = registry
        .get(name)
        .unwrap_or_else(|| panic!("{name} is linked in"));
    if let Err(why) = b.probe() {
        if std::env::var_os("KILN_REQUIRE_GPU").is_some() {
            panic!("KILN_REQUIRE_GPU is set but {name} is unavailable: {why}");
        }
        skip("batched_decode", &why);
        return None;
    }
    Some(b)
}

/// Prompt lengths for `m` sequences: 5 and `longest` among them, the rest spread between.
fn prompt_lengths(m: usize, longest: usize, rng: &mut u64) -> Vec<usize> {
    (0..m)
        .map(|i| match i {
            0 => 5,
            1 => longest,
            _ => {
                *rng = rng
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                6 + (*rng >> 33) as usize % (longest - 6)
            }
        })
        .collect()
}

fn random_prompt(len: usize, vocab: usize, rng: &mut u64) -> Vec<u32> {
    (0..len)
        .map(|_| {
            *rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            // Skip the first ids (special tokens) so no prompt ends a sequence.
            (10 + (*rng >> 33) as usize % (vocab - 10)) as u32
        })
        .collect()
}

struct Report {
    min_cosine: f64,
    mismatches: usize,
    /// The widest top-2 gap at which a pick differed.
    widest_tie: f32,
    /// Rows under the cosine bar that the CPU oracle found the batched step closer to.
    oracle_judged: usize,
}

/// Greedy: `m` sequences, `steps` steps, batched on `batched` vs one at a time on `alone`;
/// rows under the cosine bar are judged against the CPU oracle of `ir` (see the module
/// header).
#[allow(clippy::too_many_arguments)]
fn greedy_batched_vs_alone(
    ir: &kiln_core::ModelIr,
    alone: &mut dyn LayerExecutor,
    batched: &mut dyn LayerExecutor,
    m: usize,
    longest: usize,
    steps: usize,
    seed: u64,
    tie_gap: f32,
) -> Report {
    let vocab = alone.config().vocab_size;
    let mut rng = seed;
    let lens = prompt_lengths(m, longest, &mut rng);
    let prompts: Vec<Vec<u32>> = lens
        .iter()
        .map(|&l| random_prompt(l, vocab, &mut rng))
        .collect();
    let mut one = vec![f32::NAN; vocab];
    let (mut sa, mut sb): (Vec<SeqId>, Vec<SeqId>) = (Vec::new(), Vec::new());
    let mut ref_logits = vec![vec![0f32; vocab]; m];
    for (i, p) in prompts.iter().enumerate() {
        sa.push(alone.new_sequence().unwrap());
        sb.push(batched.new_sequence().unwrap());
        alone.prefill(sa[i], p, &mut ref_logits[i]).unwrap();
        batched.prefill(sb[i], p, &mut one).unwrap();
    }
    let mut report = Report {
        min_cosine: 1.0,
        mismatches: 0,
        widest_tie: 0.0,
        oracle_judged: 0,
    };
    let mut batch_logits = vec![f32::NAN; m * vocab];
    // Each row's tokens so far (prompt, then the tokens fed), for the oracle's replays.
    let mut history: Vec<Vec<u32>> = prompts.clone();
    let mut oracle: Option<kiln_backend_cpu::CpuExecutor> = None;
    for step in 0..steps {
        let tokens: Vec<u32> = ref_logits.iter().map(|l| argmax(l)).collect();
        for (h, &t) in history.iter_mut().zip(&tokens) {
            h.push(t);
        }
        let items: Vec<DecodeItem> = sb
            .iter()
            .zip(&tokens)
            .map(|(&seq, &token)| DecodeItem { seq, token })
            .collect();
        batch_logits.fill(f32::NAN);
        batched.decode(&items, &mut batch_logits).unwrap();
        for i in 0..m {
            ref_logits[i].fill(f32::NAN);
            alone
                .decode(
                    &[DecodeItem {
                        seq: sa[i],
                        token: tokens[i],
                    }],
                    &mut ref_logits[i],
                )
                .unwrap();
            let got = &batch_logits[i * vocab..(i + 1) * vocab];
            assert!(
                got.iter().all(|x| x.is_finite()),
                "M={m} step {step} row {i}: non-finite batched logits"
            );
            let cos = cosine(&ref_logits[i], got);
            report.min_cosine = report.min_cosine.min(cos);
            if cos < MIN_COSINE {
                let cpu = oracle.get_or_insert_with(|| {
                    let options = LoadOptions {
                        max_context: alone.max_context(),
                        ..LoadOptions::default()
                    };
                    kiln_tests::cpu_oracle(ir, &options)
                });
                let seq = cpu.new_sequence().unwrap();
                let mut want = vec![f32::NAN; vocab];
                cpu.prefill(seq, &history[i], &mut want).unwrap();
                cpu.free_sequence(seq).unwrap();
                // The replay's last pass ends with this step's token: its routing, at the
                // batched matmuls' 8-bit rounding.
                let routing =
                    kiln_tests::RoutingSlack::of(cpu, kiln_tests::RoutingSlack::TIE_8_BIT);
                let slack = routing.as_ref().map_or(0.0, |r| r.slack());
                let (to_batched, to_alone) = (cosine(&want, got), cosine(&want, &ref_logits[i]));
                println!(
                    "M={m} step {step} row {i} (prompt {}): batched vs one-sequence cosine {cos:.7}; \
                     to the CPU oracle: batched {to_batched:.7}, one-sequence {to_alone:.7}{}",
                    lens[i],
                    routing.as_ref().map_or(String::new(), |r| format!(
                        "; {} near-tie layers (narrowest margin {:.1e})",
                        r.near_ties, r.margin
                    ))
                );
                assert!(
                    (to_batched >= MIN_COSINE && to_batched >= to_alone) || cos >= MIN_COSINE - slack,
                    "M={m} step {step} row {i} (prompt {}): cosine {cos} to the one-sequence step, \
                     and the batched row is not the closer to the CPU oracle ({to_batched} against {to_alone})",
                    lens[i]
                );
                report.oracle_judged += 1;
            }
            let (want, have) = (argmax(&ref_logits[i]), argmax(got));
            if want != have {
                report.mismatches += 1;
                let gap = top_gap(&ref_logits[i]);
                assert!(gap < tie_gap, "M={m} step {step} row {i}: batched picks {have}, alone {want}, top-2 gap {gap} (bar {tie_gap})");
                report.widest_tie = report.widest_tie.max(gap);
            }
        }
    }
    for (a, b) in sa.into_iter().zip(sb) {
        alone.free_sequence(a).unwrap();
        batched.free_sequence(b).unwrap();
    }
    report
}

/// Seeded sampling settings of sequence `i` (top-k, temperature, top-p: the device sampler's),
/// three in four with a logit bias (one of those greedy), some ids past every vocabulary.
fn sampling_params(i: usize) -> SamplingParams {
    let t = 17 * i as u32 + 3;
    let (temperature, logit_bias) = match i % 4 {
        0 => (0.8, Vec::new()),
        1 => (0.8, vec![(t, 4.0), (5, -100.0), (u32::MAX, 1.0)]),
        2 => (0.0, vec![(t, 30.0)]),
        _ => (0.8, vec![(i as u32, 2.5), (i as u32 + 1, -1.5)]),
    };
    SamplingParams {
        temperature,
        top_k: 40,
        top_p: 0.95,
        min_p: 0.0,
        seed: 1000 + i as u64,
        logit_bias,
        ..SamplingParams::default()
    }
}

/// `m` sequences, each with its own seeded sampler, prefilled from the same random prompts,
/// then `steps` tokens each through `exec`: with `on_device`, by `decode_sample` on all of
/// them at once (the device draws, from the sampler's generator); otherwise by `decode`
/// of all at once and each sampler drawing on the host from its row of logits. With
/// `together == false` the sequences step one at a time. Returns each sequence's tokens.
fn sample_run(
    exec: &mut dyn LayerExecutor,
    m: usize,
    steps: usize,
    on_device: bool,
    together: bool,
) -> Vec<Vec<u32>> {
    let vocab = exec.config().vocab_size;
    let mut rng = 99u64;
    let prompts: Vec<Vec<u32>> = (0..m)
        .map(|i| random_prompt(4 + i % 7, vocab, &mut rng))
        .collect();
    let mut samplers: Vec<Sampler> = (0..m).map(|i| Sampler::new(sampling_params(i))).collect();
    let mut logits = vec![0f32; vocab];
    let mut seqs = Vec::new();
    let mut last = Vec::new();
    for (p, sampler) in prompts.iter().zip(&mut samplers) {
        let s = exec.new_sequence().unwrap();
        exec.prefill(s, p, &mut logits).unwrap();
        last.push(sampler.sample(&mut logits));
        seqs.push(s);
    }
    let mut out: Vec<Vec<u32>> = last.iter().map(|&t| vec![t]).collect();
    let mut rows = vec![0f32; m * vocab];
    for _ in 0..steps {
        let items: Vec<DecodeItem> = seqs
            .iter()
            .zip(&last)
            .map(|(&seq, &token)| DecodeItem { seq, token })
            .collect();
        let mut next = vec![0u32; m];
        let groups: Vec<std::ops::Range<usize>> = if together {
            vec![0..m]
        } else {
            (0..m).map(|i| i..i + 1).collect()
        };
        for g in groups {
            if on_device {
                exec.decode_sample(&items[g.clone()], &mut samplers[g.clone()], &mut next[g])
                    .unwrap();
            } else {
                let logits = &mut rows[g.start * vocab..g.end * vocab];
                logits.fill(f32::NAN);
                exec.decode(&items[g.clone()], logits).unwrap();
                for (i, row) in g.zip(logits.chunks_mut(vocab)) {
                    next[i] = samplers[i].sample(row);
                }
            }
        }
        for (o, &t) in out.iter_mut().zip(&next) {
            o.push(t);
        }
        last = next;
    }
    for s in seqs {
        exec.free_sequence(s).unwrap();
    }
    out
}

/// Seeded sampling in a batch: the device's draws equal the host sampler's on the same
/// batched logits, token for token (the batched step is bit-reproducible and both samplers
/// take top-k → temperature → top-p in the same order from the same generator). Returns
/// how many of the `m` sequences also drew the same tokens batched as alone (reported, not
/// required: the batched matmuls round differently from the one-sequence GEMVs, so a draw
/// near a boundary of the distribution may go either way, and the sequence then departs).
fn sampled_batched(
    alone: &mut dyn LayerExecutor,
    batched: &mut dyn LayerExecutor,
    m: usize,
    steps: usize,
) -> usize {
    let device = sample_run(batched, m, steps, true, true);
    let host = sample_run(batched, m, steps, false, true);
    for (i, (d, h)) in device.iter().zip(&host).enumerate() {
        assert_eq!(d, h, "sequence {i} of {m}: the device drew other tokens than the host sampler on the same logits");
    }
    let one_at_a_time = sample_run(alone, m, steps, true, false);
    one_at_a_time
        .iter()
        .zip(&device)
        .filter(|(a, b)| a == b)
        .count()
}

fn check_backend(
    backend: &dyn Backend,
    model: &Model,
    name: &str,
    sizes: &[usize],
    longest: usize,
    steps: usize,
) {
    let options = LoadOptions {
        max_context: longest + steps + 8,
        max_sequences: 64,
        ..Default::default()
    };
    let mut alone = backend.load(&model.ir, &options).unwrap();
    let mut batched = backend.load(&model.ir, &options).unwrap();
    let bar = tie_gap(&model.ir);
    for &m in sizes {
        let r = greedy_batched_vs_alone(
            &model.ir,
            alone.as_mut(),
            batched.as_mut(),
            m,
            longest,
            steps,
            7 + m as u64,
            bar,
        );
        println!(
            "{name:<28} {:<9} M={m:<2} {steps} steps: min cosine {:.7}, greedy mismatches {} (widest top-2 gap {:.1e}, bar {bar}), \
             {} rows under the bar judged closer to the oracle",
            backend.name(),
            r.min_cosine,
            r.mismatches,
            r.widest_tie,
            r.oracle_judged
        );
    }
    let m = 16;
    let same = sampled_batched(alone.as_mut(), batched.as_mut(), m, 32);
    println!(
        "{name:<28} {:<9} seeded sampling, M={m}, 32 steps: device draws = host draws on the batched logits; \
         {same}/{m} sequences also drew the same tokens one at a time",
        backend.name()
    );
}

#[test]
fn cpu_batched_decode_matches_one_at_a_time() {
    let Some(cpu) = backend("cpu") else { return };
    let dir = scratch_dir("cpu");
    let path = dir.join("smollm2.q4_0.gguf");
    synth_file(
        &path,
        SynthOptions {
            preset: Preset::SmolLm2_135m,
            recipe: Recipe::Q4_0,
            seed: 5,
        },
        &no_progress,
    )
    .unwrap();
    let model = Model::open(&path).unwrap();
    check_backend(
        cpu.as_ref(),
        &model,
        "synthetic smollm2 q4_0",
        &[1, 2, 3, 7],
        300,
        8,
    );
    std::fs::remove_dir_all(&dir).ok();
}

fn gpu_case(backend_name: &str, preset: Preset, recipe: Recipe, file: &str) {
    gpu_case_sized(
        backend_name,
        preset,
        recipe,
        file,
        &[1, 2, 3, 7, 16, 32, 64],
        1500,
        64,
    )
}

/// [`check_backend`] on a synthetic `preset` in `recipe`, batches of `sizes` sequences up
/// to `longest` tokens long, `steps` steps.
fn gpu_case_sized(
    backend_name: &str,
    preset: Preset,
    recipe: Recipe,
    file: &str,
    sizes: &[usize],
    longest: usize,
    steps: usize,
) {
    let Some(gpu) = backend(backend_name) else {
        return;
    };
    let dir = scratch_dir(file);
    let path = dir.join(file);
    synth_file(
        &path,
        SynthOptions {
            preset,
            recipe,
            seed: 5,
        },
        &no_progress,
    )
    .unwrap();
    let model = Model::open(&path).unwrap();
    check_backend(gpu.as_ref(), &model, file, sizes, longest, steps);
    std::fs::remove_dir_all(&dir).ok();
}

/// A Mixture of Experts batched: each row's tokens route to their own experts, synthetic
/// qwen3moe-small (64 experts, 8 a token) on both GPU executors: the expert GEMVs a slot
/// per token and chosen expert up to M=7, the grouped matmuls from M=8 (8·8 slots cover
/// the 64 experts).
#[test]
#[ignore = "needs an NVIDIA GPU; run scripts/gpu/gpu_suite.sh on the device"]
fn gpu_batched_decode_qwen3moe() {
    for (backend, recipe) in [("cuda-q4k", Recipe::Q4_K_M), ("cuda-q4_0", Recipe::Q4_0)] {
        let file = format!("qwen3moe-small.{}.gguf", recipe.name());
        gpu_case_sized(
            backend,
            Preset::Qwen3MoeSmall,
            recipe,
            &file,
            &[1, 2, 7, 16, 64],
            300,
            16,
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU; run scripts/gpu/gpu_suite.sh on the device"]
fn gpu_batched_decode_llama32_1b_q4_k_m() {
    gpu_case(
        "cuda-q4k",
        Preset::Llama32_1b,
        Recipe::Q4_K_M,
        "llama3.2-1b.q4_k_m.gguf",
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU; run scripts/gpu/gpu_suite.sh on the device"]
fn gpu_batched_decode_llama32_1b_q4_0() {
    gpu_case(
        "cuda-q4_0",
        Preset::Llama32_1b,
        Recipe::Q4_0,
        "llama3.2-1b.q4_0.gguf",
    );
}

/// llama.cpp's low-bit mixes in the batched step, each type on one backend: IQ4_XS and Q2_K
/// on cuda-q4k, IQ4_NL and Q3_K_M on cuda-q4_0 (the batched int8 matmuls map each IQ4 code
/// to its level and multiply the 2- and 3-bit K-quants half a chunk at a time).
#[test]
#[ignore = "needs an NVIDIA GPU; run scripts/gpu/gpu_suite.sh on the device"]
fn gpu_batched_decode_llama32_1b_low_bit_mixes() {
    for (backend, recipe) in [
        ("cuda-q4k", Recipe::IQ4_XS),
        ("cuda-q4_0", Recipe::IQ4_NL),
        ("cuda-q4k", Recipe::Q2_K),
        ("cuda-q4_0", Recipe::Q3_K_M),
    ] {
        let file = format!("llama3.2-1b.{}.gguf", recipe.name());
        gpu_case(backend, Preset::Llama32_1b, recipe, &file);
    }
}

/// The grid I-quant mixes in the batched step (their batched int8 matmuls read each chunk's
/// grid values as signed bytes; IQ2_XS, IQ2_S and IQ1_M a scale per 16 values, half a chunk
/// at a time), alternating backends.
#[test]
#[ignore = "needs an NVIDIA GPU; run scripts/gpu/gpu_suite.sh on the device"]
fn gpu_batched_decode_llama32_1b_grid_iquants() {
    for (backend, recipe) in [
        ("cuda-q4k", Recipe::IQ2_XXS),
        ("cuda-q4_0", Recipe::IQ2_XS),
        ("cuda-q4k", Recipe::IQ2_S),
        ("cuda-q4_0", Recipe::IQ3_XXS),
        ("cuda-q4k", Recipe::IQ3_S),
        ("cuda-q4_0", Recipe::IQ1_S),
        ("cuda-q4k", Recipe::IQ1_M),
    ] {
        let file = format!("llama3.2-1b.{}.gguf", recipe.name());
        gpu_case(backend, Preset::Llama32_1b, recipe, &file);
    }
}

/// Gemma 3 (post-norms, GeGLU, sliding-window rings) in the batched step: a sequence at
/// 1,100 tokens (past the window, around its ring) beside short ones.
#[test]
#[ignore = "needs an NVIDIA GPU; run scripts/gpu/gpu_suite.sh on the device"]
fn gpu_batched_decode_gemma3_270m() {
    let Some(gpu) = backend("cuda-q4k") else {
        return;
    };
    let file = "gemma3-270m.q4_k_m.gguf";
    let dir = scratch_dir(file);
    let path = dir.join(file);
    synth_file(
        &path,
        SynthOptions {
            preset: Preset::Gemma3_270m,
            recipe: Recipe::Q4_K_M,
            seed: 5,
        },
        &no_progress,
    )
    .unwrap();
    let model = Model::open(&path).unwrap();
    check_backend(gpu.as_ref(), &model, file, &[1, 2, 3, 7, 16], 1100, 32);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
#[ignore = "needs an NVIDIA GPU; run scripts/gpu/gpu_suite.sh on the device"]
fn gpu_batched_decode_real_smollm2() {
    let Some(source) = kiln_tests::smollm2_or_skip("gpu_batched_decode_real_smollm2") else {
        assert!(
            std::env::var_os("KILN_REQUIRE_GPU").is_none(),
            "the GPU suite needs the real model (KILN_TEST_MODEL)"
        );
        return;
    };
    for (backend_name, recipe, file) in [
        ("cuda-q4k", Recipe::Q4_K_M, "smollm2.q4_k_m.gguf"),
        ("cuda-q4_0", Recipe::Q4_0, "smollm2.q4_0.gguf"),
    ] {
        let Some(gpu) = backend(backend_name) else {
            return;
        };
        let dir = scratch_dir(file);
        let path = dir.join(file);
        quantize_file(
            &source,
            &path,
            QuantizeOptions {
                recipe,
                measure_error: false,
            },
            &no_progress,
        )
        .unwrap();
        let model = Model::open(&path).unwrap();
        check_backend(
            gpu.as_ref(),
            &model,
            &format!("real {file}"),
            &[1, 2, 3, 7, 16, 32, 64],
            1500,
            64,
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// 10,000 random operations on one executor — admit (new sequence + prefill of a random
/// prompt), decode a random batch of the live sequences, truncate one, finish one — with
/// every slot accounted for: the executor never holds more than `max_sequences`, a freed
/// slot is taken again, an admission past capacity is a typed error that changes nothing,
/// and no sequence sees another's KV: every 250 operations each live sequence's next logits
/// equal those of its own token history replayed alone on a fresh executor. With a tight
/// KV pool (a third of every sequence's full context), admissions and decode batches the
/// pool has no blocks for fail with `KvCacheFull` and change nothing. At the end, after
/// finishing everything, all `max_sequences` slots can be taken again and every KV block
/// is back in the pool.
fn random_operations(
    backend: &dyn Backend,
    model: &kiln_core::ModelIr,
    ops: usize,
    seed: u64,
    batched: bool,
    pool: Pool,
) {
    let mut options = LoadOptions {
        max_context: 96,
        max_sequences: 6,
        sequential_decode: !batched,
        ..Default::default()
    };
    if pool == Pool::Tight {
        // A third of the default pool (every sequence's full context), learnt from it.
        let usage = backend
            .load(model, &options)
            .unwrap()
            .kv_blocks()
            .expect("the executor pages its KV cache");
        options.kv_memory = Some((usage.total / 3 * usage.block_bytes) as u64);
    }
    let mut exec = backend.load(model, &options).unwrap();
    let total_blocks = exec
        .kv_blocks()
        .expect("the executor pages its KV cache")
        .total;
    let vocab = model.config.vocab_size;
    let max_seqs = exec.max_sequences();
    let mut rng = kiln_core::Rng::new(seed);
    let mut live: Vec<(SeqId, Vec<u32>)> = Vec::new();
    let mut logits = vec![0f32; vocab];
    let mut counts = [0usize; 5];
    let mut cache_full = 0usize;
    for op in 0..ops {
        let r = rng.next_u64() % 100;
        if r < 25 {
            // Admit.
            let prompt: Vec<u32> = (0..1 + rng.next_u64() % 12)
                .map(|_| (rng.next_u64() % vocab as u64) as u32)
                .collect();
            match exec.new_sequence() {
                Ok(seq) => {
                    assert!(live.len() < max_seqs, "op {op}: a sequence beyond capacity");
                    match exec.prefill(seq, &prompt, &mut logits) {
                        Ok(()) => {
                            live.push((seq, prompt));
                            counts[0] += 1;
                        }
                        Err(kiln_core::Error::KvCacheFull { .. }) => {
                            // No blocks for the prompt: refused whole, the sequence still
                            // empty; the scheduler would queue it, this test drops it.
                            assert_eq!(exec.sequence_len(seq).unwrap(), 0, "op {op}");
                            exec.free_sequence(seq).unwrap();
                            cache_full += 1;
                        }
                        Err(e) => panic!("op {op}: {e}"),
                    }
                }
                Err(kiln_core::Error::InvalidArgument(_)) => {
                    assert_eq!(live.len(), max_seqs, "op {op}: refused with free slots");
                    counts[4] += 1;
                }
                Err(e) => panic!("op {op}: {e}"),
            }
        } else if r < 70 && !live.is_empty() {
            // Decode a random subset that has room.
            let mut items = Vec::new();
            for (seq, toks) in &live {
                if toks.len() + 1 < options.max_context && rng.next_u64().is_multiple_of(2) {
                    items.push(DecodeItem {
                        seq: *seq,
                        token: (rng.next_u64() % vocab as u64) as u32,
                    });
                }
            }
            let mut out = vec![0f32; items.len() * vocab];
            match exec.decode(&items, &mut out) {
                Ok(()) => {
                    for it in &items {
                        live.iter_mut()
                            .find(|(s, _)| *s == it.seq)
                            .unwrap()
                            .1
                            .push(it.token);
                    }
                    counts[1] += 1;
                }
                // Refused whole: no length changed (checked below).
                Err(kiln_core::Error::KvCacheFull { .. }) => cache_full += 1,
                Err(e) => panic!("op {op}: {e}"),
            }
        } else if r < 80 && !live.is_empty() {
            // Truncate (roll back part of a conversation).
            let i = (rng.next_u64() % live.len() as u64) as usize;
            let keep = 1 + (rng.next_u64() % live[i].1.len() as u64) as usize;
            let keep = keep.min(live[i].1.len());
            exec.truncate_sequence(live[i].0, keep).unwrap();
            live[i].1.truncate(keep);
            counts[2] += 1;
        } else if !live.is_empty() {
            // Finish (or cancel) one.
            let i = (rng.next_u64() % live.len() as u64) as usize;
            let (seq, _) = live.swap_remove(i);
            exec.free_sequence(seq).unwrap();
            assert!(
                exec.sequence_len(seq).is_err(),
                "op {op}: a freed sequence is still alive"
            );
            counts[3] += 1;
        }
        for (seq, toks) in &live {
            assert_eq!(exec.sequence_len(*seq).unwrap(), toks.len(), "op {op}");
        }
        if op % 250 == 249 {
            // Isolation: one more token on each live sequence equals its history alone.
            let mut fresh = backend.load(model, &options).unwrap();
            for (seq, toks) in live.iter_mut() {
                if toks.len() + 1 >= options.max_context {
                    continue;
                }
                let t = (rng.next_u64() % vocab as u64) as u32;
                let mut got = vec![0f32; vocab];
                match exec.decode(
                    &[DecodeItem {
                        seq: *seq,
                        token: t,
                    }],
                    &mut got,
                ) {
                    Ok(()) => {}
                    Err(kiln_core::Error::KvCacheFull { .. }) => {
                        assert_eq!(exec.sequence_len(*seq).unwrap(), toks.len(), "op {op}");
                        cache_full += 1;
                        continue;
                    }
                    Err(e) => panic!("op {op}: {e}"),
                }
                toks.push(t);
                let alone = fresh.new_sequence().unwrap();
                let mut want = vec![0f32; vocab];
                fresh.prefill(alone, toks, &mut want).unwrap();
                fresh.free_sequence(alone).unwrap();
                let cos = cosine(&got, &want);
                assert!(
                    cos >= 0.9999,
                    "op {op}: sequence {seq} (history {}) cosine {cos} to its history alone",
                    toks.len()
                );
            }
        }
    }
    for (seq, _) in live.drain(..) {
        exec.free_sequence(seq).unwrap();
    }
    let usage = exec.kv_blocks().unwrap();
    assert_eq!(
        (usage.total, usage.free),
        (total_blocks, total_blocks),
        "every KV block back in the pool"
    );
    let all: Vec<SeqId> = (0..max_seqs)
        .map(|_| exec.new_sequence().unwrap())
        .collect();
    assert_eq!(all.len(), max_seqs, "every slot returned");
    assert!(exec.new_sequence().is_err());
    println!(
        "{}{}, {pool:?} pool of {total_blocks} blocks: {ops} random operations: {} admitted, {} decode batches, {} truncations, {} finished, {} refused at capacity, {cache_full} refused with KvCacheFull; all {max_seqs} slots and {total_blocks} blocks free at the end",
        backend.name(),
        if batched { " (batched decode)" } else { "" },
        counts[0],
        counts[1],
        counts[2],
        counts[3],
        counts[4]
    );
}

/// The KV pool [`random_operations`] runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pool {
    /// Every sequence's full context (no `kv_memory`).
    Default,
    /// A third of that: sequences compete for blocks.
    Tight,
}

#[test]
fn cpu_random_admit_decode_truncate_finish_keeps_sequences_apart() {
    let Some(cpu) = backend("cpu") else { return };
    for pool in [Pool::Default, Pool::Tight] {
        random_operations(
            cpu.as_ref(),
            &kiln_tests::tiny_llama(32),
            10_000,
            kiln_core::testdata::fresh_seed(),
            false,
            pool,
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU; run scripts/gpu/gpu_suite.sh on the device"]
fn gpu_random_admit_decode_truncate_finish_keeps_sequences_apart() {
    for name in ["cuda-q4k", "cuda-q4_0"] {
        let Some(gpu) = backend(name) else { return };
        for batched in [false, true] {
            for pool in [Pool::Default, Pool::Tight] {
                random_operations(
                    gpu.as_ref(),
                    &kiln_tests::tiny_llama(32),
                    2_000,
                    kiln_core::testdata::fresh_seed(),
                    batched,
                    pool,
                );
            }
        }
    }
}
