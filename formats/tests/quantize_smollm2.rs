//! `kiln quantize --type q4_k_m` on the real SmolLM2-135M (Q4_1 with a Q8_0 embedding):
//! prints every tensor's relative RMSE against the input dequantised to f32, checks the
//! type mix llama.cpp would choose, and runs the result on the CPU backend.

use std::path::PathBuf;

use kiln_backend_cpu::CpuBackend;
use kiln_core::{LayerExecutor, LoadOptions, QType};
use kiln_formats::gguf::GgufFile;
use kiln_formats::model::model_from_gguf;
use kiln_formats::quantize::{no_progress, quantize_file, type_mix, QuantizeOptions, Recipe};

fn model_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KILN_TEST_MODEL") {
        return Some(PathBuf::from(p));
    }
    let home = std::env::var_os("HOME")?;
    let p = PathBuf::from(home).join(".cache/kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    p.exists().then_some(p)
}

#[test]
fn smollm2_q4_k_m_per_tensor_error() {
    let Some(input) = model_path() else {
        println!(
            "skipped: SmolLM2 not found (set KILN_TEST_MODEL or put it in ~/.cache/kiln/models)"
        );
        return;
    };
    let out = std::env::temp_dir().join(format!("kiln-smollm2-q4_k_m-{}.gguf", std::process::id()));
    let start = std::time::Instant::now();
    let options = QuantizeOptions {
        recipe: Recipe::Q4_K_M,
        measure_error: true,
    };
    let reports = quantize_file(&input, &out, options, &no_progress).unwrap();
    println!(
        "quantised {} tensors in {:.1} s",
        reports.len(),
        start.elapsed().as_secs_f64()
    );
    println!(
        "{:<28} {:>12} {:>6} -> {:<6} {:>10}",
        "tensor", "dims", "from", "to", "rel RMSE"
    );
    let mut worst: f64 = 0.0;
    for r in &reports {
        let e = r
            .rel_rmse
            .map_or("copied".to_string(), |e| format!("{e:.5}"));
        println!(
            "{:<28} {:>12} {:>6} -> {:<6} {:>10}",
            r.name,
            format!("{:?}", r.dims),
            r.from.name(),
            r.to.name(),
            e
        );
        if let Some(e) = r.rel_rmse {
            worst = worst.max(e);
            // Against an already-4-bit input the error is that of re-rounding onto a new
            // grid: Q5_0/Q8_0/Q6_K must stay well under Q4 noise, Q4_K around it.
            let bound = match r.to {
                QType::Q8_0 | QType::Q6_K => 0.05,
                QType::Q5_0 | QType::Q4_K => 0.12,
                _ => 1.0,
            };
            assert!(e < bound, "{}: {} relative RMSE {e}", r.name, r.to);
        }
    }
    println!("worst relative RMSE {worst:.5}");

    let file = GgufFile::open(&out).unwrap();
    assert_eq!(file.get_u64("general.file_type"), Some(15));
    for (q, n, bytes) in type_mix(&file) {
        println!("  {q:>5}: {n:>3} tensors, {:.1} MB", bytes as f64 / 1e6);
    }
    let ty = |name: &str| file.tensor(name).unwrap().qtype;
    assert_eq!(ty("token_embd.weight"), QType::Q8_0);
    assert_eq!(ty("blk.0.attn_q.weight"), QType::Q5_0);
    assert_eq!(ty("blk.0.attn_v.weight"), QType::Q8_0);
    assert_eq!(ty("blk.3.attn_v.weight"), QType::Q5_0);
    assert_eq!(ty("blk.0.ffn_down.weight"), QType::Q6_K);
    assert_eq!(ty("blk.3.ffn_down.weight"), QType::Q4_K);
    assert_eq!(ty("blk.0.attn_norm.weight"), QType::F32);

    // The quantised model still predicts what the original does on a simple prompt.
    let orig = GgufFile::open(&input).unwrap();
    let tok = kiln_formats::tokenizer::Tokenizer::from_gguf(&orig).unwrap();
    let tokens = tok
        .encode("The capital of France is", false, false)
        .unwrap();
    let top = |f: &GgufFile| {
        let ir = model_from_gguf(f, "smollm2").unwrap();
        let mut ex = CpuBackend
            .load_executor(
                &ir,
                &LoadOptions {
                    max_context: 32,
                    ..Default::default()
                },
            )
            .unwrap();
        let seq = ex.new_sequence().unwrap();
        let mut logits = vec![0.0f32; ir.config.vocab_size];
        ex.prefill(seq, &tokens, &mut logits).unwrap();
        kiln_core::argmax(&logits)
    };
    let (a, b) = (top(&orig), top(&file));
    println!(
        "next token: original {a} {:?}, q4_k_m {b} {:?}",
        tok.decode(&[a], false),
        tok.decode(&[b], false)
    );
    assert_eq!(
        a, b,
        "the q4_k_m model's top next token differs from the original's"
    );
    drop(file);
    std::fs::remove_file(out).unwrap();
}
