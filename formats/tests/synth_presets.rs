//! `kiln synth`: every preset's metadata and tensor table map to the IR of the real model
//! (checked on sparse files, so no gigabytes are generated), its tokenizer loads, and the
//! small presets, written for real, run end to end on the CPU backend with finite,
//! non-degenerate logits.

use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::path::PathBuf;
use std::time::Instant;

use kiln_backend_cpu::CpuBackend;
use kiln_core::{Architecture, LayerExecutor, LoadOptions, QType};
use kiln_formats::gguf::GgufFile;
use kiln_formats::model::model_from_gguf;
use kiln_formats::quantize::{no_progress, Recipe};
use kiln_formats::synth::{
    data_bytes, plan, synth_file, synth_gguf, synth_writer, Preset, SynthOptions,
};
use kiln_formats::tokenizer::Tokenizer;

fn temp_path(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-synth-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// Writes real bytes for the header and seeks over the tensor data, leaving a sparse file
/// whose data reads as zeros.
struct SparseData {
    file: File,
    header_left: u64,
}

impl Write for SparseData {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = buf.len() as u64;
        if self.header_left > 0 {
            let take = n.min(self.header_left) as usize;
            self.file.write_all(&buf[..take])?;
            self.header_left -= take as u64;
            self.file
                .seek(SeekFrom::Current((buf.len() - take) as i64))?;
        } else {
            self.file.seek(SeekFrom::Current(n as i64))?;
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

#[test]
fn every_preset_maps_to_the_real_models_config() {
    for preset in Preset::ALL {
        let options = SynthOptions {
            preset,
            recipe: Recipe::Q4_K_M,
            seed: 0,
        };
        let (writer, planned) = synth_writer(options).unwrap();
        let file_len = writer.file_len();
        let data_len: u64 = planned
            .iter()
            .map(|t| t.qtype.tensor_bytes(&t.dims).unwrap() as u64)
            .sum();
        let path = temp_path(&format!("{}.sparse.gguf", preset.name()));
        let file = File::create(&path).unwrap();
        let mut stream = writer
            .begin(SparseData {
                file,
                header_left: file_len - data_len,
            })
            .unwrap();
        // Tensors are padded to the alignment; the writer pads, the sink seeks.
        static ZEROS: [u8; 1 << 16] = [0; 1 << 16];
        while let Some((_, qtype, dims)) = stream.next_tensor() {
            let mut left = qtype.tensor_bytes(dims).unwrap();
            while left > 0 {
                let n = left.min(ZEROS.len());
                stream.write_tensor_data(&ZEROS[..n]).unwrap();
                left -= n;
            }
        }
        let sink = stream.finish().unwrap();
        sink.file.set_len(file_len).unwrap();
        drop(sink);

        let gguf = GgufFile::open(&path).unwrap();
        let ir = model_from_gguf(&gguf, preset.name())
            .unwrap_or_else(|e| panic!("{}: {e}", preset.name()));
        let (s, c, l0) = (preset.shape(), &ir.config, &ir.weights.layers[0]);
        assert_eq!(c.arch, s.arch, "{}", preset.name());
        assert_eq!(
            (
                c.vocab_size,
                c.hidden_size,
                c.num_layers,
                c.num_heads,
                c.num_kv_heads,
                c.head_dim,
                c.ffn_size
            ),
            (
                s.vocab_size,
                s.hidden_size,
                s.num_layers,
                s.num_heads,
                s.num_kv_heads,
                s.head_dim,
                s.ffn_size
            ),
            "{}",
            preset.name()
        );
        assert_eq!(
            (
                c.tied_embeddings,
                l0.attn_q_bias.is_some(),
                l0.attn_q_norm.is_some()
            ),
            (s.tied_embeddings, s.qkv_bias, s.qk_norm),
            "{}",
            preset.name()
        );
        assert_eq!(c.rope.theta, s.rope_theta);
        assert_eq!(c.context_length, s.context_length);
        assert_eq!(
            ir.weights.rope_freqs.is_some(),
            s.llama3_rope.is_some(),
            "{}",
            preset.name()
        );

        let tok = Tokenizer::from_gguf(&gguf)
            .unwrap_or_else(|e| panic!("{}: tokenizer: {e}", preset.name()));
        assert_eq!(tok.vocab_size(), s.vocab_size);
        let text = "Hello, world! Ünïcödé ✓";
        let ids = tok.encode(text, false, false).unwrap();
        assert_eq!(
            tok.decode(&ids, false),
            text,
            "{}: byte-level round trip",
            preset.name()
        );
        let eos = tok.eos().expect("an eos token");
        assert!(tok.is_special(eos));
        let params: usize = planned
            .iter()
            .map(|t| t.dims.iter().product::<usize>())
            .sum();
        println!(
            "{:>13}: {:>5.2} B parameters, q4_k_m data {:>6.0} MiB, {} tensors",
            preset.name(),
            params as f64 / 1e9,
            data_bytes(preset, Recipe::Q4_K_M).unwrap() as f64 / (1 << 20) as f64,
            planned.len()
        );
        drop(gguf);
        std::fs::remove_file(&path).unwrap();
    }
}

#[test]
fn real_sizes_and_shapes() {
    let params = |p: Preset| {
        plan(p, Recipe::F16)
            .iter()
            .map(|t| t.dims.iter().product::<usize>())
            .sum::<usize>()
    };
    // Published parameter counts (embeddings included, tied heads counted once).
    assert_eq!(params(Preset::SmolLm2_135m), 134_515_008);
    assert_eq!(params(Preset::Llama3_8b), 8_030_261_248);
    // Llama 3.1: the same tensors plus rope_freqs (one factor per rotary pair).
    assert_eq!(params(Preset::Llama31_8b), 8_030_261_248 + 64);
    assert_eq!(Preset::Llama31_8b.shape().context_length, 131_072);
    assert_eq!(params(Preset::Qwen25_7b), 7_615_616_512);
    let q3 = Preset::Qwen3_0_6b.shape();
    assert_eq!(
        (q3.head_dim, q3.num_heads * q3.head_dim, q3.hidden_size),
        (128, 2048, 1024)
    );
    assert_eq!(Preset::Qwen25_0_5b.shape().hidden_size, 896);
    assert!(Preset::Qwen25_0_5b.shape().qkv_bias);
    assert_eq!(Preset::from_name("Qwen3-8B").unwrap(), Preset::Qwen3_8b);
    // gpt-oss: the safetensors' counts; in llama.cpp's MXFP4_MOE mix the 20b's data is
    // the 12.1 GB of its published GGUF.
    assert_eq!(params(Preset::GptOss20b), 20_914_757_184);
    assert_eq!(params(Preset::GptOss120b), 116_829_156_672);
    assert_eq!(
        data_bytes(Preset::GptOss20b, Recipe::MXFP4_MOE).unwrap(),
        12_096_558_336
    );
    assert!(Preset::from_name("gpt-5").is_err());
}

/// Prefills a prompt and decodes a few tokens, checking the logits each time.
fn run_on_cpu(path: &std::path::Path, name: &str) {
    let gguf = GgufFile::open(path).unwrap();
    let ir = model_from_gguf(&gguf, name).unwrap();
    let tok = Tokenizer::from_gguf(&gguf).unwrap();
    let options = LoadOptions {
        max_context: 64,
        ..LoadOptions::default()
    };
    let mut exec = CpuBackend.load_executor(&ir, &options).unwrap();
    let seq = exec.new_sequence().unwrap();
    let vocab = ir.config.vocab_size;
    let mut logits = vec![0.0f32; vocab];
    let prompt = tok.encode("The quick brown fox", true, false).unwrap();
    exec.prefill(seq, &prompt, &mut logits).unwrap();
    let mut generated = Vec::new();
    for step in 0..4 {
        assert!(
            logits.iter().all(|v| v.is_finite()),
            "{name}: non-finite logits at step {step}"
        );
        let mean = logits.iter().map(|&v| f64::from(v)).sum::<f64>() / vocab as f64;
        let var = logits
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / vocab as f64;
        assert!(
            var.sqrt() > 0.1,
            "{name}: logits nearly constant (std {}) at step {step}",
            var.sqrt()
        );
        let next = kiln_core::argmax(&logits) as u32;
        generated.push(next);
        exec.decode(&[kiln_core::DecodeItem { seq, token: next }], &mut logits)
            .unwrap();
    }
    println!(
        "{name}: logits std ok; greedy continuation {:?} = {:?}",
        generated,
        tok.decode(&generated, false)
    );
}

#[test]
fn small_presets_run_end_to_end_on_the_cpu_backend() {
    // Q4_K_M for the smallest (exercising the 576-wide fallbacks), Q4_0 for the others to
    // keep the test quick and the files small (CI machines can be short of disk); the
    // K-quant paths are the same code. One file exists at a time.
    for (preset, recipe) in [
        (Preset::SmolLm2_135m, Recipe::Q4_K_M),
        (Preset::Qwen25_0_5b, Recipe::Q4_0),
        (Preset::Qwen3_0_6b, Recipe::Q4_0),
    ] {
        let path = temp_path(&format!("{}-{}.gguf", preset.name(), recipe.name()));
        let start = Instant::now();
        let written = synth_file(
            &path,
            SynthOptions {
                preset,
                recipe,
                seed: 42,
            },
            &no_progress,
        )
        .unwrap();
        let secs = start.elapsed().as_secs_f64();
        let bytes = std::fs::metadata(&path).unwrap().len();
        let params: usize = written
            .iter()
            .map(|t| t.dims.iter().product::<usize>())
            .sum();
        println!(
            "synth {} {}: {:.1} MB in {secs:.1} s ({:.1} M params/s on {} threads)",
            preset.name(),
            recipe.name(),
            bytes as f64 / 1e6,
            params as f64 / secs / 1e6,
            rayon::current_num_threads()
        );
        if preset == Preset::SmolLm2_135m {
            let types: Vec<QType> = written.iter().map(|t| t.qtype).collect();
            assert!(
                types.contains(&QType::Q5_0)
                    && types.contains(&QType::Q6_K)
                    && types.contains(&QType::Q8_0)
            );
        }
        assert_eq!(
            preset.shape().arch == Architecture::Qwen3,
            written
                .iter()
                .any(|t| t.name.ends_with("attn_q_norm.weight"))
        );
        run_on_cpu(&path, preset.name());
        std::fs::remove_file(&path).unwrap();
    }
}

/// Hashes what is written and keeps its last `TAIL` bytes, so determinism is checked
/// without putting three model files on disk at once (CI machines can be short of disk).
struct Fingerprint {
    hasher: std::collections::hash_map::DefaultHasher,
    len: u64,
    tail: Vec<u8>,
}

const TAIL: usize = 1 << 20;

impl Fingerprint {
    fn of(options: SynthOptions) -> (u64, u64, Vec<u8>) {
        let mut f = Fingerprint {
            hasher: Default::default(),
            len: 0,
            tail: Vec::new(),
        };
        synth_gguf(&mut f, options, &no_progress).unwrap();
        use std::hash::Hasher;
        (f.hasher.finish(), f.len, f.tail)
    }
}

impl Write for Fingerprint {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        use std::hash::Hasher;
        self.hasher.write(buf);
        self.len += buf.len() as u64;
        self.tail.extend_from_slice(buf);
        if self.tail.len() > 2 * TAIL {
            self.tail.drain(..self.tail.len() - TAIL);
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn synthesis_is_deterministic_and_seeded() {
    let opts = |seed| SynthOptions {
        preset: Preset::SmolLm2_135m,
        recipe: Recipe::Q8_0,
        seed,
    };
    let a = Fingerprint::of(opts(1));
    // A different thread count must not change the bytes.
    let b = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap()
        .install(|| Fingerprint::of(opts(1)));
    let c = Fingerprint::of(opts(2));
    assert!(a.1 > (100 << 20), "only {} bytes written", a.1);
    assert!(a == b, "same seed, different thread count: different bytes");
    // The seed is also in general.name; compare the tensor data at the end of the file.
    let tail = |v: &[u8]| v[v.len() - TAIL..].to_vec();
    assert!(
        tail(&a.2) != tail(&c.2),
        "different seeds gave the same weights"
    );
}
