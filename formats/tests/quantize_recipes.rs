//! Per-tensor type choices of each recipe, checked against what llama.cpp's
//! `llama_tensor_get_type` picks for the same names and shapes (tables written out by hand
//! from its rules, not computed with kiln's own helpers), and `kiln quantize` on a small
//! file: types, metadata, 1-D tensors untouched, errors in bounds, requantisation.

use kiln_core::QType;
use kiln_formats::gguf::{GgufFile, GgufValue, GgufWriter};
use kiln_formats::quantize::{
    no_progress, plan_types, quantize_gguf, QuantizeOptions, Recipe, TensorDesc,
};
use kiln_formats::synth::{self, Preset};

use QType::*;

/// Tensor table of a llama-shaped model in file order, every 2-D tensor in `matrix`.
fn llama_table(
    layers: usize,
    hidden: usize,
    kv: usize,
    ffn: usize,
    vocab: usize,
    tied: bool,
    matrix: QType,
) -> Vec<TensorDesc> {
    let mut t = Vec::new();
    let mut push = |name: String, dims: Vec<usize>| {
        let qtype = if dims.len() == 1 { F32 } else { matrix };
        t.push(TensorDesc { name, dims, qtype });
    };
    push("token_embd.weight".into(), vec![hidden, vocab]);
    for i in 0..layers {
        push(format!("blk.{i}.attn_norm.weight"), vec![hidden]);
        push(format!("blk.{i}.attn_q.weight"), vec![hidden, hidden]);
        push(format!("blk.{i}.attn_k.weight"), vec![hidden, kv]);
        push(format!("blk.{i}.attn_v.weight"), vec![hidden, kv]);
        push(format!("blk.{i}.attn_output.weight"), vec![hidden, hidden]);
        push(format!("blk.{i}.ffn_norm.weight"), vec![hidden]);
        push(format!("blk.{i}.ffn_gate.weight"), vec![hidden, ffn]);
        push(format!("blk.{i}.ffn_up.weight"), vec![hidden, ffn]);
        push(format!("blk.{i}.ffn_down.weight"), vec![ffn, hidden]);
    }
    push("output_norm.weight".into(), vec![hidden]);
    if !tied {
        push("output.weight".into(), vec![hidden, vocab]);
    }
    t
}

fn type_of(table: &[TensorDesc], types: &[QType], name: &str) -> QType {
    types[table
        .iter()
        .position(|t| t.name == name)
        .unwrap_or_else(|| panic!("no tensor {name}"))]
}

/// Layers that llama.cpp's `use_more_bits` picks, written out for 30 and 32 layers.
const MORE_BITS_30: [usize; 14] = [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29];
const MORE_BITS_32: [usize; 16] = [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31];

#[test]
fn smollm2_shapes_follow_llama_cpp() {
    // SmolLM2-135M: 30 layers, hidden 576 (not a multiple of 256), FFN 1536, tied head.
    let table = llama_table(30, 576, 192, 1536, 49152, true, F32);
    let check = |recipe: Recipe, expect: &dyn Fn(&str, usize) -> QType| {
        let types = plan_types(recipe, &table, 30);
        for (t, &q) in table.iter().zip(&types) {
            let layer = t
                .name
                .strip_prefix("blk.")
                .and_then(|r| r.split('.').next())
                .map_or(usize::MAX, |l| l.parse().unwrap());
            let role = t
                .name
                .rsplit_once(".weight")
                .map_or(t.name.as_str(), |(a, _)| a.rsplit('.').next().unwrap());
            assert_eq!(q, expect(role, layer), "{recipe}: {}", t.name);
        }
    };
    let more = |l: usize| MORE_BITS_30.contains(&l);
    check(Recipe::Q4_K_M, &|role, l| match role {
        "attn_norm" | "ffn_norm" | "output_norm" => F32,
        "token_embd" => Q8_0, // the tied head: Q6_K wanted, 576 columns → Q8_0
        "attn_v" if more(l) => Q8_0, // Q6_K → fallback Q8_0
        "ffn_down" if more(l) => Q6_K,
        "ffn_down" => Q4_K,
        _ => Q5_0, // Q4_K → fallback Q5_0
    });
    check(Recipe::Q5_K_M, &|role, l| match role {
        "attn_norm" | "ffn_norm" | "output_norm" => F32,
        "token_embd" => Q8_0,
        "attn_v" if more(l) => Q8_0,
        "ffn_down" if more(l) => Q6_K,
        "ffn_down" => Q5_K,
        _ => Q5_1, // Q5_K → fallback Q5_1
    });
    check(Recipe::Q4_K_S, &|role, l| match role {
        "attn_norm" | "ffn_norm" | "output_norm" => F32,
        "token_embd" => Q8_0,
        "attn_v" if l < 4 => Q5_1, // Q5_K → Q5_1
        "ffn_down" if l < 30 / 8 => Q5_K,
        "ffn_down" => Q4_K,
        _ => Q5_0,
    });
    check(Recipe::Q6_K, &|role, _| match role {
        "attn_norm" | "ffn_norm" | "output_norm" => F32,
        "ffn_down" => Q6_K,
        _ => Q8_0,
    });
    check(Recipe::Q4_0, &|role, _| match role {
        "attn_norm" | "ffn_norm" | "output_norm" => F32,
        "token_embd" => Q8_0, // Q6_K wanted for the head, 576 columns → Q8_0
        _ => Q4_0,
    });
    check(Recipe::Q8_0, &|role, _| {
        if role.ends_with("norm") {
            F32
        } else {
            Q8_0
        }
    });
    check(Recipe::F16, &|role, _| {
        if role.ends_with("norm") {
            F32
        } else {
            F16
        }
    });
}

#[test]
fn llama3_8b_shapes_follow_llama_cpp() {
    let table = llama_table(32, 4096, 1024, 14336, 128256, false, F16);
    let types = plan_types(Recipe::Q4_K_M, &table, 32);
    assert_eq!(type_of(&table, &types, "token_embd.weight"), Q4_K);
    assert_eq!(type_of(&table, &types, "output.weight"), Q6_K);
    assert_eq!(type_of(&table, &types, "output_norm.weight"), F32);
    for l in 0..32 {
        let want = if MORE_BITS_32.contains(&l) {
            Q6_K
        } else {
            Q4_K
        };
        assert_eq!(
            type_of(&table, &types, &format!("blk.{l}.attn_v.weight")),
            want,
            "attn_v {l}"
        );
        assert_eq!(
            type_of(&table, &types, &format!("blk.{l}.ffn_down.weight")),
            want,
            "ffn_down {l}"
        );
        for role in ["attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"] {
            assert_eq!(
                type_of(&table, &types, &format!("blk.{l}.{role}.weight")),
                Q4_K
            );
        }
    }
    let s = plan_types(Recipe::Q4_K_S, &table, 32);
    for l in 0..32 {
        let v = if l < 4 { Q5_K } else { Q4_K };
        assert_eq!(type_of(&table, &s, &format!("blk.{l}.attn_v.weight")), v);
        assert_eq!(type_of(&table, &s, &format!("blk.{l}.ffn_down.weight")), v);
    }
    assert_eq!(type_of(&table, &s, "output.weight"), Q6_K);
    let q40 = plan_types(Recipe::Q4_0, &table, 32);
    assert_eq!(type_of(&table, &q40, "output.weight"), Q6_K);
    assert_eq!(type_of(&table, &q40, "token_embd.weight"), Q4_0);
    assert_eq!(type_of(&table, &q40, "blk.0.attn_v.weight"), Q4_0);
    let q80 = plan_types(Recipe::Q8_0, &table, 32);
    assert_eq!(type_of(&table, &q80, "output.weight"), Q8_0);
}

#[test]
fn rows_no_type_tiles_fall_back_to_f16() {
    let table = vec![TensorDesc {
        name: "blk.0.attn_q.weight".into(),
        dims: vec![100, 8],
        qtype: F32,
    }];
    assert_eq!(plan_types(Recipe::Q4_K_M, &table, 1), vec![F16]);
    assert_eq!(plan_types(Recipe::Q4_0, &table, 1), vec![F16]);
    // 1-D tensors keep their type whatever it is; [n, 1] counts as 1-D, as in ggml.
    let table = vec![
        TensorDesc {
            name: "blk.0.attn_q.bias".into(),
            dims: vec![256],
            qtype: F16,
        },
        TensorDesc {
            name: "blk.0.x.weight".into(),
            dims: vec![256, 1],
            qtype: F32,
        },
    ];
    assert_eq!(plan_types(Recipe::Q4_K_M, &table, 1), vec![F16, F32]);
    assert_eq!(Recipe::from_name("Q4_K_M").unwrap().file_type(), 15);
    assert!(Recipe::from_name("q3_k_l").is_err());
}

/// Deterministic pseudo-normal values without transcendental functions (the same on every
/// platform): the sum of three uniforms from an integer hash, centred.
fn value(seed: u64, i: u64) -> f32 {
    let mut z = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let mut sum = 0.0f32;
    for _ in 0..3 {
        z ^= z >> 31;
        z = z.wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 29;
        sum += (z >> 40) as f32 / (1u64 << 24) as f32;
    }
    (sum - 1.5) * 2.0
}

/// A two-layer llama model (hidden 320, one 64-wide head, FFN 256, vocab 32, untied) with
/// 2-D tensors in `matrix` and f32 norms, as GGUF bytes.
pub fn tiny_model(matrix: QType) -> Vec<u8> {
    let (h, hd, ffn, vocab, layers) = (320usize, 64usize, 256usize, 32usize, 2usize);
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "llama").unwrap();
    w.add_kv("general.file_type", GgufValue::U32(0)).unwrap();
    for (k, v) in [
        ("llama.block_count", layers),
        ("llama.embedding_length", h),
        ("llama.feed_forward_length", ffn),
        ("llama.attention.head_count", 1),
        ("llama.attention.head_count_kv", 1),
        ("llama.attention.key_length", hd),
        ("llama.context_length", 256),
    ] {
        w.add_kv(k, GgufValue::U32(v as u32)).unwrap();
    }
    w.add_kv(
        "llama.attention.layer_norm_rms_epsilon",
        GgufValue::F32(1e-5),
    )
    .unwrap();
    let mut n = 0u64;
    let mut add = |w: &mut GgufWriter, name: String, dims: Vec<usize>| {
        n += 1;
        let count: usize = dims.iter().product();
        let qtype = if dims.len() == 1 { F32 } else { matrix };
        let scale = if dims.len() == 1 {
            0.1
        } else {
            1.0 / (dims[0] as f32).sqrt()
        };
        let offset = if dims.len() == 1 { 1.0 } else { 0.0 };
        let vals: Vec<f32> = (0..count as u64)
            .map(|i| offset + scale * value(n, i))
            .collect();
        let mut bytes = vec![0u8; qtype.tensor_bytes(&dims).unwrap()];
        kiln_core::quant::quantize(qtype, &vals, &mut bytes).unwrap();
        w.add_tensor(name, qtype, dims, bytes).unwrap();
    };
    add(&mut w, "token_embd.weight".into(), vec![h, vocab]);
    for i in 0..layers {
        add(&mut w, format!("blk.{i}.attn_norm.weight"), vec![h]);
        add(&mut w, format!("blk.{i}.attn_q.weight"), vec![h, hd]);
        add(&mut w, format!("blk.{i}.attn_k.weight"), vec![h, hd]);
        add(&mut w, format!("blk.{i}.attn_v.weight"), vec![h, hd]);
        add(&mut w, format!("blk.{i}.attn_output.weight"), vec![hd, h]);
        add(&mut w, format!("blk.{i}.ffn_norm.weight"), vec![h]);
        add(&mut w, format!("blk.{i}.ffn_gate.weight"), vec![h, ffn]);
        add(&mut w, format!("blk.{i}.ffn_up.weight"), vec![h, ffn]);
        add(&mut w, format!("blk.{i}.ffn_down.weight"), vec![ffn, h]);
    }
    add(&mut w, "output_norm.weight".into(), vec![h]);
    add(&mut w, "output.weight".into(), vec![h, vocab]);
    w.write_to(Vec::new()).unwrap()
}

fn open(bytes: Vec<u8>) -> GgufFile {
    GgufFile::from_storage(std::sync::Arc::new(bytes)).unwrap()
}

#[test]
fn quantizing_a_small_model_writes_the_planned_types() {
    let input = open(tiny_model(Q8_0));
    for recipe in Recipe::ALL {
        let options = QuantizeOptions {
            recipe,
            measure_error: true,
        };
        let mut out = Vec::new();
        // A mix kiln cannot make is refused with where to turn, unless every tensor of this
        // small file falls back to a type it can make (rows of 320 values tile no K-quant).
        let reports = match quantize_gguf(&input, &mut out, options, &no_progress) {
            Err(e) if !recipe.can_quantize() => {
                assert!(e.to_string().contains("kiln synth --type"), "{recipe}: {e}");
                continue;
            }
            result => result.unwrap(),
        };
        let output = open(out);
        assert_eq!(
            output.get_u64("general.file_type"),
            Some(u64::from(recipe.file_type())),
            "{recipe}"
        );
        assert_eq!(output.get_u64("general.quantization_version"), Some(2));
        assert_eq!(
            output.get_usize("llama.block_count"),
            Some(2),
            "{recipe}: metadata copied"
        );
        kiln_formats::model::model_from_gguf(&output, "quantized").unwrap();
        for (t, r) in output.tensors().iter().zip(&reports) {
            assert_eq!((t.name.as_str(), t.qtype), (r.name.as_str(), r.to));
            let src = input.view_by_name(&t.name).unwrap().unwrap();
            if t.dims.len() == 1 {
                assert_eq!(t.qtype, F32);
                assert_eq!(
                    output.view(t).unwrap().bytes(),
                    src.bytes(),
                    "{recipe}: {} copied",
                    t.name
                );
                continue;
            }
            let bound = match t.qtype {
                Q8_0 => {
                    assert!(r.rel_rmse.is_none(), "Q8_0 → Q8_0 is a copy");
                    assert_eq!(output.view(t).unwrap().bytes(), src.bytes());
                    continue;
                }
                F16 => 0.001,
                Q6_K => 0.03,
                Q5_0 | Q5_1 | Q5_K => 0.06,
                Q4_0 | Q4_1 | Q4_K | IQ4_NL | IQ4_XS => 0.12,
                other => panic!("{recipe}: unexpected type {other} for {}", t.name),
            };
            let e = r.rel_rmse.unwrap();
            assert!(
                e < bound,
                "{recipe}: {} as {}: relative RMSE {e}",
                t.name,
                t.qtype
            );
            // The measured error is the error of the file's bytes.
            let y = output.view(t).unwrap().to_f32().unwrap();
            let x = src.to_f32().unwrap();
            let num: f64 = x
                .iter()
                .zip(&y)
                .map(|(a, b)| f64::from(a - b).powi(2))
                .sum();
            let den: f64 = x.iter().map(|a| f64::from(*a).powi(2)).sum();
            assert!(((num / den).sqrt() - e).abs() < 1e-9);
        }
        let mix: Vec<QType> = output.tensors().iter().map(|t| t.qtype).collect();
        match recipe {
            Recipe::Q4_K_M => {
                assert!(mix.contains(&Q4_K) && mix.contains(&Q6_K) && mix.contains(&Q5_0))
            }
            Recipe::Q5_K_M => {
                assert!(mix.contains(&Q5_K) && mix.contains(&Q6_K) && mix.contains(&Q5_1))
            }
            _ => {}
        }
    }
}

#[test]
fn requantising_goes_through_f32_and_refuses_nothing_readable() {
    // From Q4_1 (lossy) to Q4_K_M: the result is close to the Q4_1 values it was given.
    let input = open(tiny_model(Q4_1));
    let mut out = Vec::new();
    let options = QuantizeOptions {
        recipe: Recipe::Q4_K_M,
        measure_error: true,
    };
    let reports = quantize_gguf(&input, &mut out, options, &no_progress).unwrap();
    assert!(reports
        .iter()
        .filter(|r| r.from == Q4_1)
        .all(|r| r.rel_rmse.unwrap() < 0.12));
    // And F16 from it is exact to f16 rounding.
    let mut out = Vec::new();
    let options = QuantizeOptions {
        recipe: Recipe::F16,
        measure_error: true,
    };
    let reports = quantize_gguf(&input, &mut out, options, &no_progress).unwrap();
    assert!(reports
        .iter()
        .filter(|r| r.to == F16)
        .all(|r| r.rel_rmse.unwrap() < 5e-4));
}

const FIXTURE: &str = "tests/fixtures/quantize_python.json";
/// Recipes whose output the Python fixture checks (every quantised type appears in one).
const FIXTURE_RECIPES: [Recipe; 4] = [Recipe::Q4_K_M, Recipe::Q5_K_M, Recipe::Q4_1, Recipe::Q4_K_S];

fn fixture_output(recipe: Recipe) -> Vec<u8> {
    let input = open(tiny_model(Q8_0));
    let mut out = Vec::new();
    quantize_gguf(
        &input,
        &mut out,
        QuantizeOptions {
            recipe,
            measure_error: false,
        },
        &no_progress,
    )
    .unwrap();
    out
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Writes the files `scripts/fixtures/make_quantize_fixture.py` reads with the `gguf` package.
#[test]
#[ignore = "run by scripts/fixtures/make_quantize_fixture.py"]
fn write_python_fixture_inputs() {
    let dir = std::env::var("KILN_QUANTIZE_FIXTURE_DIR").expect("KILN_QUANTIZE_FIXTURE_DIR");
    for recipe in FIXTURE_RECIPES {
        std::fs::write(
            format!("{dir}/{}.gguf", recipe.name()),
            fixture_output(recipe),
        )
        .unwrap();
    }
}

/// kiln's quantised files, read by the `gguf` Python package (an independent reader and
/// dequantiser): the same tensors, types and shapes, and the same dequantised values.
#[test]
fn python_gguf_reads_kiln_output_and_agrees_on_values() {
    let fx: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(FIXTURE).unwrap()).unwrap();
    for recipe in FIXTURE_RECIPES {
        let bytes = fixture_output(recipe);
        let case = &fx[recipe.name()];
        // The bytes Python read are the bytes kiln writes today.
        assert_eq!(
            case["sha256"].as_str().unwrap(),
            sha256_hex(&bytes),
            "{recipe}: output changed; regenerate the fixture"
        );
        let file = open(bytes);
        let tensors = case["tensors"].as_array().unwrap();
        assert_eq!(tensors.len(), file.tensors().len(), "{recipe}");
        for t in tensors {
            let name = t["name"].as_str().unwrap();
            let info = file
                .tensor(name)
                .unwrap_or_else(|| panic!("{recipe}: {name} missing"));
            assert_eq!(
                t["type"].as_u64().unwrap() as u32,
                info.qtype.ggml_id(),
                "{recipe}: {name} type"
            );
            let dims: Vec<usize> = t["dims"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .collect();
            assert_eq!(dims, info.dims, "{recipe}: {name} dims (ggml order)");
            let y = file.view(info).unwrap().to_f32().unwrap();
            let sum: f64 = y.iter().map(|&v| f64::from(v)).sum();
            let sumsq: f64 = y.iter().map(|&v| f64::from(v).powi(2)).sum();
            let (psum, psumsq) = (t["sum"].as_f64().unwrap(), t["sumsq"].as_f64().unwrap());
            assert!(
                (sum - psum).abs() <= 1e-6 * psumsq.sqrt().max(1.0),
                "{recipe}: {name} sum {sum} vs gguf {psum}"
            );
            assert!(
                (sumsq - psumsq).abs() <= 1e-6 * psumsq.max(1.0),
                "{recipe}: {name} sumsq {sumsq} vs {psumsq}"
            );
            for s in t["samples"].as_array().unwrap() {
                let (i, v) = (
                    s[0].as_u64().unwrap() as usize,
                    s[1].as_f64().unwrap() as f32,
                );
                assert!(
                    (y[i] - v).abs() <= 1e-6 * v.abs().max(1e-3),
                    "{recipe}: {name}[{i}] = {} vs gguf {v}",
                    y[i]
                );
            }
        }
    }
}

/// Mixture-of-Experts files as llama.cpp's recipes type them: the router stays f32, the
/// stacked experts take the dense roles' rules (`ffn_down_exps` the more-bits layers of
/// `ffn_down`), and an 8-expert model (Mixtral) keeps attn_k and attn_v in Q8_0.
#[test]
fn moe_shapes_follow_llama_cpp() {
    for (preset, experts) in [(Preset::Mixtral8x7b, 8), (Preset::Qwen3_30bA3b, 128)] {
        let plan = synth::plan(preset, Recipe::Q4_K_M);
        let layers = preset.shape().num_layers;
        let more = match layers {
            32 => &MORE_BITS_32[..],
            _ => &[][..],
        };
        let ty = |name: &str| {
            plan.iter()
                .find(|t| t.name == name)
                .unwrap_or_else(|| panic!("no tensor {name}"))
                .qtype
        };
        let mut downs_q6 = 0;
        for l in 0..layers {
            let n = |r: &str| format!("blk.{l}.{r}.weight");
            assert_eq!(ty(&n("ffn_gate_inp")), F32, "{preset:?} router");
            assert_eq!(ty(&n("ffn_gate_exps")), Q4_K);
            assert_eq!(ty(&n("ffn_up_exps")), Q4_K);
            let down = ty(&n("ffn_down_exps"));
            downs_q6 += usize::from(down == Q6_K);
            if !more.is_empty() {
                assert_eq!(down == Q6_K, more.contains(&l), "{preset:?} down {l}");
            }
            let attn_k = if experts == 8 { Q8_0 } else { Q4_K };
            assert_eq!(ty(&n("attn_k")), attn_k, "{preset:?} attn_k {l}");
            if experts == 8 {
                assert_eq!(ty(&n("attn_v")), Q8_0, "{preset:?} attn_v {l}");
            }
        }
        assert!(
            downs_q6 > 0 && downs_q6 < layers,
            "{preset:?}: {downs_q6} of {layers}"
        );
    }
}

/// An older Mixtral file's per-expert tensors (`blk.L.ffn_down.E.weight`) take their
/// layer's type, as llama.cpp's `layer_info` reads the layer from the name.
#[test]
fn per_expert_tensors_count_by_their_layer() {
    let stacked = synth::plan(Preset::Mixtral8x7b, Recipe::Q4_K_M);
    let mut table = Vec::new();
    for t in &stacked {
        match t.name.strip_suffix("_exps.weight") {
            Some(stem) => table.extend((0..8).map(|e| TensorDesc {
                name: format!("{stem}.{e}.weight"),
                dims: t.dims[..2].to_vec(),
                qtype: F16,
            })),
            None => table.push(TensorDesc {
                qtype: if t.dims.len() == 1 { F32 } else { F16 },
                ..t.clone()
            }),
        }
    }
    let types = plan_types(Recipe::Q4_K_M, &table, 32);
    for l in 0..32 {
        let want = if MORE_BITS_32.contains(&l) {
            Q6_K
        } else {
            Q4_K
        };
        for e in 0..8 {
            let name = format!("blk.{l}.ffn_down.{e}.weight");
            assert_eq!(type_of(&table, &types, &name), want, "{name}");
        }
    }
}

/// The 2- and 3-bit mixes and the grid I-quant mixes on a llama3-8b table (32 layers, 4
/// query heads per KV head, untied head), and attention V with one query head per KV head;
/// each expectation written out from llama.cpp's rules without an importance matrix.
#[test]
fn low_bit_mixes_follow_llama_cpp() {
    let table = llama_table(32, 4096, 1024, 14336, 128256, false, F16);
    let check = |recipe: Recipe, expect: &dyn Fn(&str, usize) -> QType| {
        let types = plan_types(recipe, &table, 32);
        for (t, &q) in table.iter().zip(&types) {
            let layer = t
                .name
                .strip_prefix("blk.")
                .and_then(|r| r.split('.').next())
                .map_or(usize::MAX, |l| l.parse().unwrap());
            let role = t
                .name
                .rsplit_once(".weight")
                .map_or(t.name.as_str(), |(a, _)| a.rsplit('.').next().unwrap());
            let want = if role.ends_with("norm") {
                F32
            } else {
                expect(role, layer)
            };
            assert_eq!(q, want, "{recipe}: {}", t.name);
        }
    };
    check(Recipe::Q2_K, &|role, _| match role {
        "output" => Q6_K,
        "attn_v" => Q4_K,
        "ffn_down" | "attn_output" => Q3_K,
        _ => Q2_K,
    });
    check(Recipe::Q3_K_M, &|role, l| match role {
        "output" => Q6_K,
        "attn_v" if l < 2 => Q5_K,
        "ffn_down" if l < 32 / 16 => Q5_K,
        "attn_v" | "ffn_down" | "attn_output" => Q4_K,
        _ => Q3_K,
    });
    for (recipe, base) in [
        (Recipe::IQ2_XXS, IQ2_XXS),
        (Recipe::IQ2_XS, IQ2_XS),
        (Recipe::IQ1_S, IQ1_S),
        (Recipe::IQ1_M, IQ1_M),
    ] {
        let one_bit = matches!(recipe, Recipe::IQ1_S | Recipe::IQ1_M);
        check(recipe, &|role, l| match role {
            "output" => Q5_K,
            "token_embd" => Q2_K,
            "attn_v" => Q4_K,
            "ffn_down" if l < 32 / 8 => Q2_K,
            "attn_output" if one_bit => IQ2_XXS,
            _ => base,
        });
    }
    for (recipe, base) in [(Recipe::IQ2_S, IQ2_XS), (Recipe::IQ2_M, IQ2_S)] {
        check(recipe, &|role, l| match role {
            "output" => Q5_K,
            "token_embd" | "attn_output" => IQ3_S,
            "attn_v" => Q4_K,
            "ffn_down" if l < 32 / 8 => IQ3_S,
            _ => base,
        });
    }
    check(Recipe::IQ3_XXS, &|role, l| match role {
        "output" => Q5_K,
        "token_embd" | "attn_output" => IQ3_S,
        "attn_v" => Q4_K,
        "attn_q" | "attn_k" => IQ2_S,
        "ffn_down" if l < 32 / 8 => Q4_K,
        "ffn_down" => Q3_K,
        _ => IQ3_XXS,
    });
    check(Recipe::IQ3_S, &|role, _| match role {
        "output" => Q6_K,
        "attn_v" => Q4_K,
        _ => IQ3_S,
    });

    // One query head per KV head: attention V without the n_gqa ≥ 4 step.
    let mha = llama_table(32, 4096, 4096, 11008, 32000, false, F16);
    let v = |recipe: Recipe| {
        let types = plan_types(recipe, &mha, 32);
        type_of(&mha, &types, "blk.5.attn_v.weight")
    };
    assert_eq!(v(Recipe::Q2_K), Q3_K);
    assert_eq!(v(Recipe::IQ2_XXS), Q2_K);
    assert_eq!(v(Recipe::IQ2_M), IQ3_S);
    assert_eq!(v(Recipe::IQ3_XXS), IQ3_S);
    assert_eq!(v(Recipe::IQ3_S), IQ3_S);
}

/// `kiln quantize` refuses the mixes it cannot make with the reason and where to turn;
/// `kiln synth` writes them as random blocks whose values have the spread asked for.
#[test]
fn low_bit_mixes_are_synthesised_not_quantised() {
    for recipe in [Recipe::Q2_K, Recipe::IQ2_XXS, Recipe::IQ3_S, Recipe::IQ1_M] {
        assert!(!recipe.can_quantize(), "{recipe}");
    }
    let mut bytes = Vec::new();
    synth::synth_gguf(
        &mut bytes,
        synth::SynthOptions {
            preset: Preset::Llama32_1b,
            recipe: Recipe::IQ2_XXS,
            seed: 3,
        },
        &no_progress,
    )
    .unwrap();
    let file = GgufFile::from_storage(std::sync::Arc::new(bytes)).unwrap();
    let info = file
        .tensors()
        .iter()
        .find(|t| t.name == "blk.3.ffn_gate.weight")
        .unwrap();
    assert_eq!(info.qtype, IQ2_XXS);
    let view = file.view(info).unwrap();
    // Projections are drawn ~ N(0, 1/fan_in): the blocks' spread should match.
    let mut row = vec![0.0f32; view.row_len()];
    let (mut sum_sq, mut n) = (0.0f64, 0usize);
    for r in 0..64 {
        kiln_core::quant::dequantize(IQ2_XXS, view.row(r), &mut row).unwrap();
        assert!(row.iter().all(|v| v.is_finite()));
        sum_sq += row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>();
        n += row.len();
    }
    let rms = (sum_sq / n as f64).sqrt();
    let want = 1.0 / (view.row_len() as f64).sqrt();
    assert!((rms / want - 1.0).abs() < 0.05, "rms {rms} want {want}");
}
