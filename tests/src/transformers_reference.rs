//! Tiny random models made with Hugging Face `transformers` and written to GGUF as
//! llama.cpp's converter lays them out, with what transformers computed for them: a
//! directory of `tests/fixtures/` holding `NAME.gguf`, `NAME.logits.f32` (the prompt's
//! logits at the checked positions) and one `reference.json` (the prompt, the vocabulary
//! size, and per model the checked positions and the greedy continuation). Made by the
//! `scripts/fixtures/make_*_fixture.py` that names the directory.

use std::collections::HashMap;

use kiln_core::{DecodeItem, LayerExecutor, ModelIr};
use kiln_formats::gguf::GgufFile;
use kiln_formats::model::model_from_gguf;
use serde::Deserialize;

use crate::{cosine, cpu_executor, fixture};

/// What transformers computed for one model.
#[derive(Deserialize)]
pub struct Expected {
    pub positions: Vec<usize>,
    pub greedy: Vec<u32>,
}

#[derive(Deserialize)]
struct Reference {
    prompt_ids: Vec<u32>,
    vocab: usize,
    #[serde(flatten)]
    models: HashMap<String, serde_json::Value>,
}

/// One fixture directory.
pub struct Fixtures {
    dir: &'static str,
    reference: Reference,
}

impl Fixtures {
    pub fn open(dir: &'static str) -> Fixtures {
        let text = std::fs::read_to_string(fixture(&format!("{dir}/reference.json"))).unwrap();
        Fixtures {
            dir,
            reference: serde_json::from_str(&text).unwrap(),
        }
    }

    pub fn prompt(&self) -> &[u32] {
        &self.reference.prompt_ids
    }

    /// Model `name` as kiln reads its GGUF file.
    pub fn model(&self, name: &str) -> ModelIr {
        let file = GgufFile::open(fixture(&format!("{}/{name}.gguf", self.dir))).unwrap();
        model_from_gguf(&file, name).unwrap()
    }

    pub fn expected(&self, name: &str) -> Expected {
        serde_json::from_value(self.reference.models[name].clone()).unwrap()
    }

    fn logits(&self, name: &str) -> Vec<f32> {
        std::fs::read(fixture(&format!("{}/{name}.logits.f32", self.dir)))
            .unwrap()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    /// `exec` on model `name`'s prompt, fed in chunks ending at each checked position: the
    /// worst cosine of those positions' logits to transformers', and the greedy
    /// continuation of as many tokens as transformers made.
    pub fn run(&self, exec: &mut dyn LayerExecutor, name: &str) -> (f64, Vec<u32>) {
        let (r, expected, rows) = (&self.reference, self.expected(name), self.logits(name));
        let seq = exec.new_sequence().unwrap();
        let mut logits = vec![f32::NAN; r.vocab];
        let (mut done, mut worst) = (0, 1.0f64);
        for (row, &pos) in expected.positions.iter().enumerate() {
            exec.prefill(seq, &r.prompt_ids[done..=pos], &mut logits)
                .unwrap();
            done = pos + 1;
            worst = worst.min(cosine(&logits, &rows[row * r.vocab..(row + 1) * r.vocab]));
        }
        assert_eq!(done, r.prompt_ids.len());
        let mut tokens = Vec::new();
        for _ in 0..expected.greedy.len() {
            let token = kiln_core::argmax(&logits);
            tokens.push(token);
            exec.decode(&[DecodeItem { seq, token }], &mut logits)
                .unwrap();
        }
        (worst, tokens)
    }

    /// The CPU oracle on model `name` against transformers (cosine ≥ 0.9999 at every
    /// checked position, the greedy tokens equal); then on the same file with `break_it`
    /// applied, which must disagree (the fixture exercises what `break_it` removes).
    pub fn check_cpu(&self, name: &str, break_it: impl Fn(&mut ModelIr)) {
        let mut ir = self.model(name);
        let mut exec = cpu_executor(&ir, 256);
        let (worst, greedy) = self.run(exec.as_mut(), name);
        println!("{name}: worst cosine {worst:.7} to transformers; greedy {greedy:?}");
        assert!(worst >= 0.9999, "{name}: cosine {worst}");
        assert_eq!(greedy, self.expected(name).greedy, "{name}: greedy tokens");
        break_it(&mut ir);
        let mut exec = cpu_executor(&ir, 256);
        let (broken, _) = self.run(exec.as_mut(), name);
        println!("{name}, read without what defines it: worst cosine {broken:.4}");
        assert!(
            broken < 0.999,
            "{name}: the fixture does not need what was removed"
        );
    }
}
