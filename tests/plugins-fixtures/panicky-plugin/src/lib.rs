//! # kiln-fixture-panicky-plugin
//!
//! A plugin that misbehaves on purpose, built by tests/tests/plugins.rs: `supports` panics,
//! and its executor panics on `decode` and `decode_sample` (after which the SDK must poison it). With
//! `KILN_FIXTURE_INIT=fail` its constructor returns an error and with `=panic` it panics,
//! so one library covers both initialisation refusals. Nothing here is a real backend.

use kiln_plugin_sdk::kiln_core::{
    Architecture, Backend, DecodeItem, Error, LayerExecutor, LoadOptions, ModelConfig, ModelIr,
    QType, Result, Sampler, SeqId, Support,
};

kiln_plugin_sdk::export_backend!(try Panicky::new, architectures = [Architecture::Llama]);

pub struct Panicky;

impl Panicky {
    fn new() -> std::result::Result<Panicky, String> {
        match std::env::var("KILN_FIXTURE_INIT").as_deref() {
            Ok("fail") => Err("the fixture was told to fail".into()),
            Ok("panic") => panic!("the fixture was told to panic"),
            _ => Ok(Panicky),
        }
    }
}

impl Backend for Panicky {
    fn name(&self) -> &str {
        "panicky"
    }
    fn description(&self) -> &str {
        "test fixture that panics"
    }
    fn qtypes(&self) -> Vec<QType> {
        vec![QType::F32]
    }
    fn probe(&self) -> Result<String, String> {
        Ok("fixture device".into())
    }
    fn supports(&self, model: &ModelIr) -> Support {
        panic!("supports exploded on {}", model.source)
    }
    fn load(&self, model: &ModelIr, _options: &LoadOptions) -> Result<Box<dyn LayerExecutor>> {
        if model.source.contains("refuse") {
            return Err(Error::Unsupported("the fixture refuses this model".into()));
        }
        Ok(Box::new(PanickyExecutor {
            config: model.config.clone(),
            len: 0,
        }))
    }
}

struct PanickyExecutor {
    config: ModelConfig,
    len: usize,
}

impl LayerExecutor for PanickyExecutor {
    fn config(&self) -> &ModelConfig {
        &self.config
    }
    fn max_context(&self) -> usize {
        16
    }
    fn max_sequences(&self) -> usize {
        1
    }
    fn new_sequence(&mut self) -> Result<SeqId> {
        Ok(0)
    }
    fn free_sequence(&mut self, _seq: SeqId) -> Result<()> {
        Ok(())
    }
    fn sequence_len(&self, _seq: SeqId) -> Result<usize> {
        Ok(self.len)
    }
    fn truncate_sequence(&mut self, _seq: SeqId, len: usize) -> Result<()> {
        self.len = len;
        Ok(())
    }
    fn prefill(&mut self, _seq: SeqId, tokens: &[u32], logits: &mut [f32]) -> Result<()> {
        self.len += tokens.len();
        logits.fill(0.5);
        Ok(())
    }
    fn decode(&mut self, _batch: &[DecodeItem], _logits: &mut [f32]) -> Result<()> {
        panic!("decode exploded at length {}", self.len)
    }
    fn decode_sample(
        &mut self,
        _batch: &[DecodeItem],
        samplers: &mut [Sampler],
        _tokens: &mut [u32],
    ) -> Result<()> {
        panic!("decode_sample exploded with {} samplers", samplers.len())
    }
}
