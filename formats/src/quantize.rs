//! `kiln quantize`: rewrite a GGUF model with llama.cpp's per-tensor type recipes.
//!
//! A recipe ([`Recipe`], llama.cpp's `--type` names such as `q4_k_m`) names a default type;
//! [`plan_types`] then adjusts it per tensor the way llama.cpp's `llama_tensor_get_type`
//! does for the same tensor names, so a kiln `q4_k_m` file has the same type mix as a
//! llama.cpp one: norms and other 1-D tensors keep their type, the LM head (or the tied
//! token embedding that doubles as it) gets Q6_K, Q4_K_M gives `attn_v` and `ffn_down` Q6_K
//! in the layers `use_more_bits` picks, and a K-quant whose row length is not a multiple
//! of 256 (SmolLM2's 576) falls back to the 32-value type llama.cpp uses
//! (Q4_K→Q5_0, Q5_K→Q5_1, Q6_K→Q8_0).
//!
//! [`quantize_gguf`] streams: tensors are converted one after another, a bounded chunk of
//! rows at a time, with rayon over the rows of a chunk, while a second thread writes the
//! previous chunk. A quantised input is dequantised to f32 row by row on the way; a tensor
//! whose planned type equals its current type is copied byte for byte. Tensors are written
//! in llama.cpp's order (outside-block tensors, then block by block, by name). The same engine
//! ([`TensorEncoder`]) writes the random models of [`crate::synth`].

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::mpsc;

use kiln_core::{quant, Error, QType, Result};
use rayon::prelude::*;

use crate::gguf::{GgufFile, GgufStreamWriter, GgufValue, GgufWriter};

/// `general.file_type` key.
pub const FILE_TYPE_KEY: &str = "general.file_type";
/// `general.quantization_version` key; ggml's current block layouts are version 2.
pub const QUANTIZATION_VERSION_KEY: &str = "general.quantization_version";
const QUANTIZATION_VERSION: u32 = 2;

/// A whole-model quantisation recipe, by llama.cpp's name for it.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Recipe {
    Q4_0,
    Q4_1,
    Q8_0,
    Q4_K_S,
    Q4_K_M,
    Q5_K_M,
    Q6_K,
    F16,
    /// llama.cpp's `MXFP4_MOE` (gpt-oss's own mix): every Mixture-of-Experts tensor (a
    /// stacked 3-D expert matrix) in MXFP4, every other quantised tensor in Q8_0.
    MXFP4_MOE,
    /// llama.cpp's `IQ4_NL` and `IQ4_XS` mixes without an importance matrix.
    IQ4_NL,
    IQ4_XS,
    /// llama.cpp's 2- and 3-bit K-quant mixes (`Q2_K`, `Q3_K_M`) and its grid I-quant mixes
    /// (`IQ2_XXS` … `IQ1_M`, as it chooses them without an importance matrix). kiln runs
    /// these files and `kiln synth` writes them (random valid blocks, for speed tests); `kiln
    /// quantize` does not make them ([`Recipe::can_quantize`]).
    Q2_K,
    Q3_K_M,
    IQ2_XXS,
    IQ2_XS,
    IQ2_S,
    IQ2_M,
    IQ3_XXS,
    IQ3_S,
    IQ1_S,
    IQ1_M,
}

impl Recipe {
    pub const ALL: [Recipe; 21] = [
        Recipe::Q4_0,
        Recipe::Q4_1,
        Recipe::Q8_0,
        Recipe::Q4_K_S,
        Recipe::Q4_K_M,
        Recipe::Q5_K_M,
        Recipe::Q6_K,
        Recipe::F16,
        Recipe::MXFP4_MOE,
        Recipe::IQ4_NL,
        Recipe::IQ4_XS,
        Recipe::Q2_K,
        Recipe::Q3_K_M,
        Recipe::IQ2_XXS,
        Recipe::IQ2_XS,
        Recipe::IQ2_S,
        Recipe::IQ2_M,
        Recipe::IQ3_XXS,
        Recipe::IQ3_S,
        Recipe::IQ1_S,
        Recipe::IQ1_M,
    ];

    /// The lower-case name (`q4_k_m`), as `--type` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Recipe::Q4_0 => "q4_0",
            Recipe::Q4_1 => "q4_1",
            Recipe::Q8_0 => "q8_0",
            Recipe::Q4_K_S => "q4_k_s",
            Recipe::Q4_K_M => "q4_k_m",
            Recipe::Q5_K_M => "q5_k_m",
            Recipe::Q6_K => "q6_k",
            Recipe::F16 => "f16",
            Recipe::MXFP4_MOE => "mxfp4_moe",
            Recipe::IQ4_NL => "iq4_nl",
            Recipe::IQ4_XS => "iq4_xs",
            Recipe::Q2_K => "q2_k",
            Recipe::Q3_K_M => "q3_k_m",
            Recipe::IQ2_XXS => "iq2_xxs",
            Recipe::IQ2_XS => "iq2_xs",
            Recipe::IQ2_S => "iq2_s",
            Recipe::IQ2_M => "iq2_m",
            Recipe::IQ3_XXS => "iq3_xxs",
            Recipe::IQ3_S => "iq3_s",
            Recipe::IQ1_S => "iq1_s",
            Recipe::IQ1_M => "iq1_m",
        }
    }

    /// Whether `kiln quantize` makes this mix: not the 2- and 3-bit K mixes (no Q2_K or Q3_K
    /// quantiser yet) nor the grid I-quants, which need an importance matrix to quantise
    /// well (kiln reads none). `kiln synth` writes every mix.
    pub fn can_quantize(self) -> bool {
        quant::can_quantize(self.default_type())
    }

    /// Parses a recipe name (case-insensitive); an unknown name lists the known ones.
    pub fn from_name(name: &str) -> Result<Recipe> {
        let lower = name.to_ascii_lowercase();
        Recipe::ALL
            .iter()
            .copied()
            .find(|r| r.name() == lower)
            .ok_or_else(|| {
                let known: Vec<&str> = Recipe::ALL.iter().map(|r| r.name()).collect();
                Error::InvalidArgument(format!(
                    "unknown quantisation type '{name}' (known: {})",
                    known.join(", ")
                ))
            })
    }

    /// The type of every 2-D tensor no rule singles out (llama.cpp's `default_type`).
    pub fn default_type(self) -> QType {
        match self {
            Recipe::Q4_0 => QType::Q4_0,
            Recipe::Q4_1 => QType::Q4_1,
            Recipe::Q8_0 => QType::Q8_0,
            Recipe::Q4_K_S | Recipe::Q4_K_M => QType::Q4_K,
            Recipe::Q5_K_M => QType::Q5_K,
            Recipe::Q6_K => QType::Q6_K,
            Recipe::F16 => QType::F16,
            Recipe::MXFP4_MOE => QType::MXFP4,
            Recipe::IQ4_NL => QType::IQ4_NL,
            Recipe::IQ4_XS => QType::IQ4_XS,
            Recipe::Q2_K => QType::Q2_K,
            Recipe::Q3_K_M => QType::Q3_K,
            Recipe::IQ2_XXS => QType::IQ2_XXS,
            // llama.cpp's IQ2_S mix is mostly IQ2_XS; its IQ2_M mix is IQ2_S.
            Recipe::IQ2_XS | Recipe::IQ2_S => QType::IQ2_XS,
            Recipe::IQ2_M => QType::IQ2_S,
            Recipe::IQ3_XXS => QType::IQ3_XXS,
            Recipe::IQ3_S => QType::IQ3_S,
            Recipe::IQ1_S => QType::IQ1_S,
            Recipe::IQ1_M => QType::IQ1_M,
        }
    }

    /// llama.cpp's `llama_ftype` value, written as `general.file_type`.
    pub fn file_type(self) -> u32 {
        match self {
            Recipe::F16 => 1,
            Recipe::Q4_0 => 2,
            Recipe::Q4_1 => 3,
            Recipe::Q8_0 => 7,
            Recipe::Q4_K_S => 14,
            Recipe::Q4_K_M => 15,
            Recipe::Q5_K_M => 17,
            Recipe::Q6_K => 18,
            Recipe::MXFP4_MOE => 38,
            Recipe::IQ4_NL => 25,
            Recipe::IQ4_XS => 30,
            Recipe::Q2_K => 10,
            Recipe::Q3_K_M => 12,
            Recipe::IQ2_XXS => 19,
            Recipe::IQ2_XS => 20,
            Recipe::IQ2_S => 28,
            Recipe::IQ2_M => 29,
            Recipe::IQ3_XXS => 23,
            Recipe::IQ3_S => 26,
            Recipe::IQ1_S => 24,
            Recipe::IQ1_M => 31,
        }
    }
}

impl std::fmt::Display for Recipe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What the planner needs to know about one tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorDesc {
    pub name: String,
    /// ggml order: `dims[0]` is the row length.
    pub dims: Vec<usize>,
    /// The tensor's current type (kept when the tensor is not quantised).
    pub qtype: QType,
}

/// llama.cpp's `use_more_bits`: the first and last eighth of the layers, and every third
/// layer in between, get more bits in the `_M` mixes.
pub fn use_more_bits(i_layer: usize, n_layers: usize) -> bool {
    let (i, n) = (i_layer as i64, n_layers as i64);
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// ggml's `ggml_n_dims`: the number of dimensions up to the last one larger than 1.
fn n_dims(dims: &[usize]) -> usize {
    dims.iter().rposition(|&d| d > 1).map_or(1, |i| i + 1)
}

/// llama.cpp's processing order (`weight_name_comparer`): tensors outside the blocks first,
/// then block by block, by name within each. The `attn_v` / `ffn_down` counters of the
/// recipes run in this order, and llama.cpp writes its output in it.
pub fn llama_cpp_order(tensors: &[TensorDesc]) -> Vec<usize> {
    let layer = |name: &str| -> i64 {
        name.strip_prefix("blk.")
            .and_then(|r| r.split('.').next())
            .and_then(|l| l.parse().ok())
            .unwrap_or(-1)
    };
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by(|&a, &b| {
        let (na, nb) = (&tensors[a].name, &tensors[b].name);
        layer(na).cmp(&layer(nb)).then_with(|| na.cmp(nb))
    });
    order
}

/// The type each tensor gets under `recipe`, returned in the order given. The layer
/// counters follow [`llama_cpp_order`], whatever order the file lists the tensors in.
/// `n_layers` is the model's block count.
pub fn plan_types(recipe: Recipe, tensors: &[TensorDesc], n_layers: usize) -> Vec<QType> {
    let default = recipe.default_type();
    let has_output = tensors.iter().any(|t| t.name == "output.weight");
    let n_attention_wv = tensors
        .iter()
        .filter(|t| t.name.contains("attn_v.weight") || t.name.contains("attn_qkv.weight"))
        .count();
    let mut i_attention_wv = 0;
    let mut i_ffn_down = 0;
    // Experts a layer, from the router's shape (0 for a dense model).
    let n_expert = tensors
        .iter()
        .find(|t| t.name.ends_with("ffn_gate_inp.weight"))
        .and_then(|t| t.dims.get(1).copied())
        .unwrap_or(0);
    // Query heads per KV head, from the first layer's Q and K shapes (head sizes equal).
    let rows_of = |role: &str| {
        tensors
            .iter()
            .find(|t| t.name.ends_with(role))
            .and_then(|t| t.dims.get(1).copied())
    };
    let n_gqa = match (rows_of("attn_q.weight"), rows_of("attn_k.weight")) {
        (Some(q), Some(k)) if k > 0 => q / k,
        _ => 1,
    };
    let iq4 = matches!(recipe, Recipe::IQ4_NL | Recipe::IQ4_XS);
    // llama.cpp's lowest-bit grid mixes share one set of rules; IQ2_S and IQ2_M lean on
    // IQ3_S where the others take Q2_K.
    let grid_low = matches!(
        recipe,
        Recipe::IQ2_XXS
            | Recipe::IQ2_XS
            | Recipe::IQ2_S
            | Recipe::IQ2_M
            | Recipe::IQ1_S
            | Recipe::IQ1_M
    );
    let grid_step_up = match recipe {
        Recipe::IQ2_S | Recipe::IQ2_M => QType::IQ3_S,
        _ => QType::Q2_K,
    };
    let mut types: Vec<QType> = tensors.iter().map(|t| t.qtype).collect();
    for i in llama_cpp_order(tensors) {
        let t = &tensors[i];
        types[i] = (|| {
            // llama_model_quantize_impl: only 2-D+ weights (no bias: gpt-oss's stacked
            // expert biases are 2-D) that are not norms (nor a Mixture of Experts' router)
            // are quantised.
            let quantize = n_dims(&t.dims) >= 2
                && t.name.ends_with("weight")
                && !t.name.contains("_norm.weight")
                && !t.name.contains("ffn_gate_inp.weight");
            if !quantize {
                return t.qtype;
            }
            if !default.is_quantized() {
                return default;
            }
            let mut new_type = default;
            let name = t.name.as_str();
            let row_len = t.dims[0];
            if recipe == Recipe::MXFP4_MOE {
                // llama.cpp: the LM head and everything 2-D in Q8_0, the stacked experts
                // (a third dimension over 1) in MXFP4 — per-expert 2-D tensors of older
                // files are not experts to this rule.
                let stacked = t.dims.get(2).is_some_and(|&e| e > 1);
                let lm_head =
                    name == "output.weight" || (!has_output && name == "token_embd.weight");
                new_type = match stacked && !lm_head {
                    true => QType::MXFP4,
                    false => QType::Q8_0,
                };
            } else if name == "output.weight" || (!has_output && name == "token_embd.weight") {
                // The LM head (or the tied embedding that is it).
                if !row_len.is_multiple_of(default.block_len()) {
                    new_type = QType::Q8_0;
                } else if grid_low || recipe == Recipe::IQ3_XXS {
                    new_type = QType::Q5_K;
                } else if new_type != QType::Q8_0 {
                    new_type = QType::Q6_K;
                }
            } else if name == "token_embd.weight" {
                match recipe {
                    Recipe::IQ2_XXS | Recipe::IQ2_XS | Recipe::IQ1_S | Recipe::IQ1_M => {
                        new_type = QType::Q2_K
                    }
                    Recipe::IQ2_S | Recipe::IQ2_M | Recipe::IQ3_XXS => new_type = QType::IQ3_S,
                    _ => {}
                }
            } else if grid_low {
                if name.contains("attn_v.weight") {
                    new_type = if n_gqa >= 4 || n_expert >= 4 {
                        QType::Q4_K
                    } else {
                        grid_step_up
                    };
                    i_attention_wv += 1;
                } else if n_expert == 8 && name.contains("attn_k.weight") {
                    new_type = QType::Q4_K;
                } else if name.contains("ffn_down") {
                    if i_ffn_down < n_layers / 8 {
                        new_type = grid_step_up;
                    }
                    i_ffn_down += 1;
                } else if name.contains("attn_output.weight") {
                    new_type = match recipe {
                        _ if n_expert == 8 => QType::Q5_K,
                        Recipe::IQ1_S | Recipe::IQ1_M => QType::IQ2_XXS,
                        Recipe::IQ2_S | Recipe::IQ2_M => QType::IQ3_S,
                        _ => new_type,
                    };
                }
            } else if name.contains("attn_v.weight") {
                let more = use_more_bits(i_attention_wv, n_attention_wv);
                match recipe {
                    Recipe::Q2_K | Recipe::IQ3_S | Recipe::IQ3_XXS if n_gqa >= 4 => {
                        new_type = QType::Q4_K
                    }
                    Recipe::Q2_K => new_type = QType::Q3_K,
                    // Without an importance matrix (kiln reads none).
                    Recipe::IQ3_XXS => new_type = QType::IQ3_S,
                    Recipe::Q3_K_M if i_attention_wv < 2 => new_type = QType::Q5_K,
                    Recipe::Q3_K_M => new_type = QType::Q4_K,
                    Recipe::Q4_K_M | Recipe::Q5_K_M if more => new_type = QType::Q6_K,
                    Recipe::Q4_K_S if i_attention_wv < 4 => new_type = QType::Q5_K,
                    Recipe::IQ4_NL | Recipe::IQ4_XS if n_gqa >= 4 => new_type = QType::Q5_K,
                    _ => {}
                }
                // llama.cpp: "for the 8-expert model, bumping this to Q8_0 trades just ~128MB".
                if n_expert == 8 {
                    new_type = QType::Q8_0;
                }
                i_attention_wv += 1;
            } else if name.contains("attn_k.weight") {
                if n_expert == 8 {
                    new_type = QType::Q8_0;
                } else if recipe == Recipe::IQ3_XXS {
                    new_type = QType::IQ2_S;
                }
            } else if name.contains("attn_q.weight") {
                if recipe == Recipe::IQ3_XXS {
                    new_type = QType::IQ2_S;
                }
            } else if name.contains("ffn_down") {
                // llama.cpp's `layer_info`: a tensor per expert (`blk.L.ffn_down.E.weight`)
                // counts as its layer L, not as the next of a running count.
                let i = per_expert_layer(name).unwrap_or(i_ffn_down);
                let n = n_layers;
                match recipe {
                    Recipe::Q2_K => new_type = QType::Q3_K,
                    // Without an importance matrix.
                    Recipe::IQ3_XXS if i < n / 8 => new_type = QType::Q4_K,
                    Recipe::IQ3_XXS => new_type = QType::Q3_K,
                    Recipe::Q3_K_M if i < n / 16 => new_type = QType::Q5_K,
                    Recipe::Q3_K_M => new_type = QType::Q4_K,
                    Recipe::Q4_K_M | Recipe::Q5_K_M if use_more_bits(i, n) => {
                        new_type = QType::Q6_K
                    }
                    Recipe::Q4_K_S if i < n / 8 => new_type = QType::Q5_K,
                    // Without an importance matrix (kiln reads none).
                    Recipe::IQ4_NL | Recipe::IQ4_XS if i < n / 8 => new_type = QType::Q5_K,
                    _ => {}
                }
                i_ffn_down += 1;
            } else if name.contains("attn_output.weight") {
                // llama.cpp: the 8-expert models' attention output in Q5_K for these mixes.
                let three_or_four_bit = matches!(
                    recipe,
                    Recipe::Q2_K | Recipe::IQ3_XXS | Recipe::Q3_K_M | Recipe::IQ3_S
                ) || matches!(recipe, Recipe::Q4_K_S | Recipe::Q4_K_M)
                    || iq4;
                new_type = match recipe {
                    _ if n_expert == 8 && three_or_four_bit => QType::Q5_K,
                    _ if n_expert == 8 => new_type,
                    Recipe::Q2_K => QType::Q3_K,
                    Recipe::IQ3_XXS => QType::IQ3_S,
                    Recipe::Q3_K_M => QType::Q4_K,
                    _ => new_type,
                };
            } else if name.contains("attn_qkv.weight") {
                match recipe {
                    Recipe::Q3_K_M => new_type = QType::Q4_K,
                    Recipe::Q4_K_M => new_type = QType::Q5_K,
                    Recipe::Q5_K_M => new_type = QType::Q6_K,
                    _ => {}
                }
            }
            fallback_for_row(new_type, row_len)
        })();
    }
    types
}

/// Layer L of a per-expert tensor's name `blk.L.ffn_down.E.weight`.
fn per_expert_layer(name: &str) -> Option<usize> {
    let rest = name.strip_prefix("blk.")?;
    let (layer, role) = rest.split_once('.')?;
    let expert = role.strip_prefix("ffn_down.")?.strip_suffix(".weight")?;
    expert.parse::<usize>().ok()?;
    layer.parse().ok()
}

/// llama.cpp's `convert_incompatible_tensor`: a K-quant that cannot tile the row becomes
/// the 32-value type of similar quality; failing that, F16.
pub fn fallback_for_row(qtype: QType, row_len: usize) -> QType {
    if row_len.is_multiple_of(qtype.block_len()) {
        return qtype;
    }
    let fallback = match qtype {
        QType::Q2_K | QType::Q3_K => QType::Q4_0,
        QType::Q4_K => QType::Q5_0,
        QType::Q5_K => QType::Q5_1,
        QType::Q6_K => QType::Q8_0,
        QType::IQ4_XS
        | QType::IQ2_XXS
        | QType::IQ2_XS
        | QType::IQ2_S
        | QType::IQ3_XXS
        | QType::IQ3_S
        | QType::IQ1_S
        | QType::IQ1_M => QType::IQ4_NL,
        _ => QType::F16,
    };
    if row_len.is_multiple_of(fallback.block_len()) {
        fallback
    } else {
        QType::F16
    }
}

/// Progress of a long conversion, in values (elements) converted.
pub enum ProgressEvent<'a> {
    /// The run starts; `total` values will be converted.
    Start {
        total: u64,
    },
    /// Tensor `index` (of `count`) starts.
    Tensor {
        name: &'a str,
        index: usize,
        count: usize,
        qtype: QType,
    },
    /// `done` more values were converted.
    Advance {
        done: u64,
    },
    Finish,
}

/// A progress observer (a terminal bar, a log line, nothing).
pub type Progress<'a> = &'a (dyn Fn(ProgressEvent<'_>) + Sync);

/// A progress observer that ignores everything.
pub fn no_progress(_: ProgressEvent<'_>) {}

/// What happened to one tensor.
#[derive(Debug, Clone)]
pub struct TensorReport {
    pub name: String,
    pub dims: Vec<usize>,
    pub from: QType,
    pub to: QType,
    /// `‖quantised − source‖ / ‖source‖` over the whole tensor, when measured (the source
    /// being the input dequantised to f32). `None` when not measured or copied unchanged.
    pub rel_rmse: Option<f64>,
}

/// Options of [`quantize_gguf`].
#[derive(Debug, Clone, Copy)]
pub struct QuantizeOptions {
    pub recipe: Recipe,
    /// Also dequantise every converted row and report each tensor's relative RMSE.
    pub measure_error: bool,
}

/// Quantises the GGUF file at `input` into a new file at `output` (written beside it under
/// a temporary name and renamed when complete, so a failed run leaves no half file).
pub fn quantize_file(
    input: &Path,
    output: &Path,
    options: QuantizeOptions,
    progress: Progress,
) -> Result<Vec<TensorReport>> {
    if let (Ok(a), Ok(b)) = (input.canonicalize(), output.canonicalize()) {
        if a == b {
            return Err(Error::InvalidArgument(format!(
                "input and output are the same file ({}); the input is memory-mapped while the output is written",
                input.display()
            )));
        }
    }
    let file = GgufFile::open(input)?;
    write_atomically(output, |w| quantize_gguf(&file, w, options, progress))
}

/// Writes `output` through `write` into a temporary sibling, then renames it into place.
pub(crate) fn write_atomically<T>(
    output: &Path,
    write: impl FnOnce(&mut BufWriter<File>) -> Result<T>,
) -> Result<T> {
    let mut tmp_name = output
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_else(|| "out.gguf".into());
    tmp_name.push(".partial");
    let tmp = output.with_file_name(tmp_name);
    let result = (|| {
        let mut w = BufWriter::with_capacity(1 << 20, File::create(&tmp)?);
        let value = write(&mut w)?;
        w.flush()?;
        w.into_inner()
            .map_err(|e| Error::Io(e.into_error()))?
            .sync_all()?;
        Ok(value)
    })();
    match result {
        Ok(value) => {
            std::fs::rename(&tmp, output)?;
            Ok(value)
        }
        Err(e) => {
            // Best effort: the error that matters is the one being returned.
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// Quantises an opened GGUF file into `out` with `options.recipe`. Metadata is copied,
/// except `general.file_type` and `general.quantization_version`, which are rewritten.
pub fn quantize_gguf<W: Write + Send>(
    file: &GgufFile,
    out: W,
    options: QuantizeOptions,
    progress: Progress,
) -> Result<Vec<TensorReport>> {
    let descs: Vec<TensorDesc> = file
        .tensors()
        .iter()
        .map(|t| TensorDesc {
            name: t.name.clone(),
            dims: t.dims.clone(),
            qtype: t.qtype,
        })
        .collect();
    let n_layers = match file.architecture() {
        Some(arch) => file.get_usize(&format!("{arch}.block_count")),
        None => None,
    }
    .unwrap_or_else(|| descs.iter().filter(|t| t.name.contains("ffn_down")).count());
    let types = plan_types(options.recipe, &descs, n_layers);

    let mut writer = GgufWriter::new();
    for (key, value) in file.metadata() {
        if key != FILE_TYPE_KEY && key != QUANTIZATION_VERSION_KEY {
            writer.add_kv(key.clone(), value.clone())?;
        }
    }
    writer.add_kv(FILE_TYPE_KEY, GgufValue::U32(options.recipe.file_type()))?;
    writer.add_kv(
        QUANTIZATION_VERSION_KEY,
        GgufValue::U32(QUANTIZATION_VERSION),
    )?;
    // Written in llama.cpp's order, as its quantiser writes them.
    let order = llama_cpp_order(&descs);
    for &i in &order {
        let (t, to) = (&descs[i], types[i]);
        if to != t.qtype && !quant::can_quantize(to) {
            return Err(Error::Unsupported(format!(
                "tensor {}: kiln runs {to} weights but does not make them (no quantiser for \
                 Q2_K or Q3_K yet; the grid I-quants need an importance matrix, which kiln does \
                 not read); `kiln synth --type {}` writes random blocks of these types for speed \
                 tests",
                t.name, options.recipe
            )));
        }
        writer.declare_tensor(t.name.clone(), to, t.dims.clone())?;
    }

    let total: u64 = descs
        .iter()
        .map(|t| t.dims.iter().product::<usize>() as u64)
        .sum();
    progress(ProgressEvent::Start { total });
    let mut encoder = TensorEncoder::new(writer.begin(out)?);
    let mut reports = Vec::with_capacity(descs.len());
    for (index, &i) in order.iter().enumerate() {
        let (info, to) = (&file.tensors()[i], types[i]);
        progress(ProgressEvent::Tensor {
            name: &info.name,
            index,
            count: descs.len(),
            qtype: to,
        });
        let view = file.view(info)?;
        let rel_rmse = if to == info.qtype {
            encoder.write_bytes(
                view.bytes(),
                info.dims.iter().product::<usize>() as u64,
                progress,
            )?;
            None
        } else {
            let from = info.qtype;
            let source =
                |row: usize, values: &mut [f32]| quant::dequantize(from, view.row(row), values);
            let err = encoder.encode(
                view.row_len(),
                view.rows(),
                to,
                RowSource::Values(&source),
                options.measure_error,
                progress,
            )?;
            err.map(|e| e.relative())
        };
        reports.push(TensorReport {
            name: info.name.clone(),
            dims: info.dims.clone(),
            from: info.qtype,
            to,
            rel_rmse,
        });
    }
    encoder.finish()?;
    progress(ProgressEvent::Finish);
    Ok(reports)
}

/// Sums for a relative RMSE: `Σ(q − x)²` and `Σx²`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ErrorSums {
    pub sq_err: f64,
    pub sq_ref: f64,
}

impl ErrorSums {
    /// `sqrt(Σ(q − x)² / Σx²)`; 0 for an all-zero tensor reproduced exactly.
    pub fn relative(&self) -> f64 {
        if self.sq_ref > 0.0 {
            (self.sq_err / self.sq_ref).sqrt()
        } else if self.sq_err == 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    }
    fn add(self, o: ErrorSums) -> ErrorSums {
        ErrorSums {
            sq_err: self.sq_err + o.sq_err,
            sq_ref: self.sq_ref + o.sq_ref,
        }
    }
}

/// Values per chunk: bounds memory (one chunk being encoded, one being written) while
/// giving every core many rows.
const CHUNK_VALUES: usize = 1 << 22;

/// Encodes tensors into a [`GgufStreamWriter`] a chunk of rows at a time: rows are
/// produced and quantised in parallel, and a writer thread takes each finished chunk so
/// encoding the next overlaps the disk write.
/// Where [`TensorEncoder::encode`] gets a row.
#[derive(Clone, Copy)]
pub(crate) enum RowSource<'a> {
    /// Its f32 values, quantised to the tensor's type.
    Values(&'a (dyn Fn(usize, &mut [f32]) -> Result<()> + Sync)),
    /// Its bytes, already in the tensor's type.
    Bytes(&'a (dyn Fn(usize, &mut [u8]) -> Result<()> + Sync)),
}

pub(crate) struct TensorEncoder<W: Write + Send> {
    writer: GgufStreamWriter<W>,
}

impl<W: Write + Send> TensorEncoder<W> {
    pub(crate) fn new(writer: GgufStreamWriter<W>) -> Self {
        TensorEncoder { writer }
    }

    /// Writes bytes already in the target type.
    pub(crate) fn write_bytes(
        &mut self,
        bytes: &[u8],
        values: u64,
        progress: Progress,
    ) -> Result<()> {
        self.writer.write_tensor_data(bytes)?;
        progress(ProgressEvent::Advance { done: values });
        Ok(())
    }

    /// Encodes a tensor of `rows` rows of `row_len` values as `qtype`, asking `source` for
    /// each row (its f32 values, quantised here, or its bytes). Returns the error sums when
    /// `measure` is set (for values only).
    pub(crate) fn encode(
        &mut self,
        row_len: usize,
        rows: usize,
        qtype: QType,
        source: RowSource<'_>,
        measure: bool,
        progress: Progress,
    ) -> Result<Option<ErrorSums>> {
        let row_bytes = qtype.row_bytes(row_len)?;
        let chunk_rows = (CHUNK_VALUES / row_len.max(1)).clamp(1, rows.max(1));
        let writer = &mut self.writer;
        let (tx, rx) = mpsc::sync_channel::<Vec<u8>>(1);
        let (ret_tx, ret_rx) = mpsc::channel::<Vec<u8>>();
        std::thread::scope(|scope| {
            // The writer thread: takes finished chunks in order and hands the buffers back.
            let write_thread = scope.spawn(move || -> Result<()> {
                for chunk in rx {
                    writer.write_tensor_data(&chunk)?;
                    // The encoder may have finished already; a dropped receiver is fine.
                    let _ = ret_tx.send(chunk);
                }
                Ok(())
            });
            let encoded = (|| -> Result<ErrorSums> {
                let mut sums = ErrorSums::default();
                let mut start = 0;
                while start < rows {
                    let n = chunk_rows.min(rows - start);
                    let mut buf = ret_rx.try_recv().unwrap_or_default();
                    buf.resize(n * row_bytes, 0);
                    let chunk_sums = buf
                        .par_chunks_mut(row_bytes.max(1))
                        .enumerate()
                        .map_init(
                            || {
                                (
                                    vec![0.0f32; row_len],
                                    if measure {
                                        vec![0.0f32; row_len]
                                    } else {
                                        Vec::new()
                                    },
                                )
                            },
                            |(values, check), (i, out)| -> Result<ErrorSums> {
                                let source = match source {
                                    RowSource::Values(f) => f,
                                    RowSource::Bytes(f) => {
                                        f(start + i, out)?;
                                        return Ok(ErrorSums::default());
                                    }
                                };
                                source(start + i, values)?;
                                quant::quantize(qtype, values, out)?;
                                if !measure {
                                    return Ok(ErrorSums::default());
                                }
                                quant::dequantize(qtype, out, check)?;
                                let mut s = ErrorSums::default();
                                for (&x, &q) in values.iter().zip(check.iter()) {
                                    let d = f64::from(q) - f64::from(x);
                                    s.sq_err += d * d;
                                    s.sq_ref += f64::from(x) * f64::from(x);
                                }
                                Ok(s)
                            },
                        )
                        .try_reduce(ErrorSums::default, |a, b| Ok(a.add(b)))?;
                    sums = sums.add(chunk_sums);
                    if tx.send(buf).is_err() {
                        // The writer thread stopped: its error is reported below.
                        break;
                    }
                    progress(ProgressEvent::Advance {
                        done: (n * row_len) as u64,
                    });
                    start += n;
                }
                Ok(sums)
            })();
            drop(tx);
            let written = write_thread
                .join()
                .map_err(|_| Error::Format("GGUF writer thread panicked".into()))?;
            written?;
            let sums = encoded?;
            Ok(measure.then_some(sums))
        })
    }

    /// Checks every declared tensor was written and flushes.
    pub(crate) fn finish(self) -> Result<W> {
        Ok(self.writer.finish()?)
    }
}

/// Runs `f` on a rayon pool of `threads` workers, or on the global pool when `None`.
pub fn with_threads<T: Send>(
    threads: Option<usize>,
    f: impl FnOnce() -> Result<T> + Send,
) -> Result<T> {
    match threads {
        None => f(),
        Some(n) => rayon::ThreadPoolBuilder::new()
            .num_threads(n.max(1))
            .build()
            .map_err(|e| Error::InvalidArgument(format!("a pool of {n} threads: {e}")))?
            .install(f),
    }
}

/// The types in a file with the number of tensors and bytes of each, for `kiln inspect`
/// (the "mix" of a quantised model).
pub fn type_mix(file: &GgufFile) -> Vec<(QType, usize, u64)> {
    let mut mix: Vec<(QType, usize, u64)> = Vec::new();
    for t in file.tensors() {
        match mix.iter_mut().find(|(q, _, _)| *q == t.qtype) {
            Some(entry) => {
                entry.1 += 1;
                entry.2 += t.n_bytes as u64;
            }
            None => mix.push((t.qtype, 1, t.n_bytes as u64)),
        }
    }
    mix.sort_by_key(|m| std::cmp::Reverse(m.2));
    mix
}
