//! Tensor parallelism on the CPU: a model split over ranks that are threads of this process
//! (`LoadOptions::tensor_parallel`), each a [`CpuExecutor`] over its share of the weights
//! (`kiln_core::parallel::shard`) with its own worker threads, summing each branch's
//! partial output through a [`LocalCollective`]. The ranks run every call together; their
//! logits are each rank's vocabulary columns, put side by side here.
//!
//! What it is for: the sharding math of every architecture, run and checked against the
//! unsharded executor in CI without a GPU (tests/tests/tensor_parallel.rs), and the same
//! seam the GPU executors split through. On one host's cores it gains nothing over one
//! executor with all the threads.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use kiln_core::parallel::{self, Collective, LocalCollective};
use kiln_core::{
    program, DecodeItem, Error, KvBlockUsage, KvType, LayerExecutor, LoadOptions, ModelConfig,
    ModelIr, Result, SeqId,
};

use crate::executor::CpuExecutor;
use crate::kernels::Isa;

/// A model split over ranks (see the module doc).
pub struct TensorParallelExecutor {
    config: ModelConfig,
    ranks: Vec<CpuExecutor>,
    group: Vec<Arc<LocalCollective>>,
    /// Rank `i`'s vocabulary rows: its columns of every logits row.
    vocab: Vec<std::ops::Range<usize>>,
    /// Why the ranks can no longer run together, once they could not.
    out_of_step: Option<String>,
}

impl TensorParallelExecutor {
    /// `ir` split over `options.tensor_parallel` ranks, the worker threads
    /// (`options.threads`, or every core) shared out among them.
    pub fn load(ir: &ModelIr, options: &LoadOptions, isa: Isa) -> Result<TensorParallelExecutor> {
        let world = options.tensor_parallel.max(1);
        // Before anything is allocated per rank: a rank count from the command line is
        // bounded by the model's KV heads.
        parallel::check_heads_split(&ir.config, world)?;
        let whole = program::build(ir)?;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = options.threads.filter(|&n| n > 0).unwrap_or(cores);
        let rank_options = LoadOptions {
            threads: Some((threads / world).max(1)),
            ..options.clone()
        };
        let group: Vec<Arc<LocalCollective>> = LocalCollective::group(world)?
            .into_iter()
            .map(Arc::new)
            .collect();
        let mut ranks = Vec::with_capacity(world);
        let mut vocab = Vec::with_capacity(world);
        for (rank, collective) in group.iter().enumerate() {
            let shard = parallel::shard(&whole, &ir.config, rank, world)?;
            let collective: Arc<dyn Collective> = collective.clone();
            ranks.push(CpuExecutor::load_program(
                &shard.config,
                &shard.program,
                &rank_options,
                isa,
                Some(collective),
            )?);
            vocab.push(shard.vocab);
        }
        Ok(TensorParallelExecutor {
            config: ir.config.clone(),
            ranks,
            group,
            vocab,
            out_of_step: None,
        })
    }

    /// Ranks the model is split over.
    pub fn world(&self) -> usize {
        self.ranks.len()
    }

    /// `f` on every rank at once (they meet in their all-reduces), each with `out`'s
    /// buffer of its own. A rank that fails (or panics) breaks the group so the others
    /// fail in their next all-reduce instead of waiting for it; the error is that rank's.
    /// When every rank failed (a refused request: they all refuse it alike, or stop at the
    /// same all-reduce) the group is mended and the executor serves the next call; ranks
    /// that ended differently leave it out of step for good.
    fn on_all<T: Send>(
        &mut self,
        f: impl Fn(&mut CpuExecutor, &mut [f32]) -> Result<T> + Sync,
        out: &mut [Vec<f32>],
    ) -> Result<Vec<T>> {
        if let Some(why) = &self.out_of_step {
            return Err(Error::Backend {
                backend: "cpu".into(),
                message: why.clone(),
            });
        }
        let results: Vec<(Result<T>, bool)> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .ranks
                .iter_mut()
                .zip(out.iter_mut())
                .zip(&self.group)
                .map(|((exec, buf), group)| {
                    let f = &f;
                    s.spawn(move || {
                        let result = match catch_unwind(AssertUnwindSafe(|| f(exec, buf))) {
                            Ok(r) => r,
                            Err(panic) => {
                                let why = panic
                                    .downcast_ref::<String>()
                                    .map(String::as_str)
                                    .or_else(|| panic.downcast_ref::<&str>().copied())
                                    .unwrap_or("a panic");
                                Err(Error::Backend {
                                    backend: "cpu".into(),
                                    message: format!(
                                        "tensor-parallel rank {}: {why}",
                                        group.rank()
                                    ),
                                })
                            }
                        };
                        let broke = match &result {
                            Err(e) => group.abort(&e.to_string()),
                            Ok(_) => false,
                        };
                        (result, broke)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a rank's panic is caught inside it"))
                .collect()
        });
        let failed = results.iter().filter(|(r, _)| r.is_err()).count();
        if failed == 0 {
            return Ok(results
                .into_iter()
                .map(|(r, _)| r.expect("checked"))
                .collect());
        }
        if failed == results.len() {
            self.group[0].reset();
        } else {
            self.out_of_step = Some(
                "tensor-parallel ranks fell out of step (one failed where others did not); load the model again"
                    .into(),
            );
        }
        let first = results
            .into_iter()
            .find_map(|(r, broke)| if broke { r.err() } else { None });
        Err(first.expect("the rank that broke the group failed"))
    }

    /// Runs `f` on every rank with a logits-sized buffer each, then puts each rank's
    /// vocabulary columns of every `vocab`-wide row into `logits`.
    fn gathered(
        &mut self,
        logits: &mut [f32],
        f: impl Fn(&mut CpuExecutor, &mut [f32]) -> Result<()> + Sync,
    ) -> Result<()> {
        let mut bufs = vec![vec![0f32; logits.len()]; self.world()];
        self.on_all(f, &mut bufs)?;
        let vocab = self.config.vocab_size;
        for (buf, cols) in bufs.iter().zip(&self.vocab) {
            for (row, part) in logits.chunks_exact_mut(vocab).zip(buf.chunks_exact(vocab)) {
                row[cols.clone()].copy_from_slice(&part[cols.clone()]);
            }
        }
        Ok(())
    }

    /// `f` on every rank, which must all answer the same (sequence bookkeeping).
    fn agreed<T: Send + PartialEq + std::fmt::Debug>(
        &mut self,
        f: impl Fn(&mut CpuExecutor) -> Result<T> + Sync,
    ) -> Result<T> {
        let mut none = vec![Vec::new(); self.world()];
        let answers = self.on_all(|exec, _| f(exec), &mut none)?;
        let first = &answers[0];
        if answers.iter().any(|a| a != first) {
            return Err(Error::Backend {
                backend: "cpu".into(),
                message: format!("tensor-parallel ranks disagree: {answers:?}"),
            });
        }
        Ok(answers.into_iter().next().expect("a rank"))
    }
}

impl LayerExecutor for TensorParallelExecutor {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn kv_type(&self) -> Option<KvType> {
        self.ranks[0].kv_type()
    }

    fn kv_blocks(&self) -> Option<KvBlockUsage> {
        self.ranks[0].kv_blocks()
    }

    fn max_context(&self) -> usize {
        self.ranks[0].max_context()
    }

    fn max_sequences(&self) -> usize {
        self.ranks[0].max_sequences()
    }

    fn new_sequence(&mut self) -> Result<SeqId> {
        self.agreed(|e| e.new_sequence())
    }

    fn free_sequence(&mut self, seq: SeqId) -> Result<()> {
        self.agreed(|e| e.free_sequence(seq))
    }

    fn sequence_len(&self, seq: SeqId) -> Result<usize> {
        self.ranks[0].sequence_len(seq)
    }

    fn truncate_sequence(&mut self, seq: SeqId, len: usize) -> Result<()> {
        // A truncation that recomputes windowed rows runs a forward pass: every rank.
        let mut none = vec![Vec::new(); self.world()];
        self.on_all(|e, _| e.truncate_sequence(seq, len), &mut none)?;
        Ok(())
    }

    fn prefill(&mut self, seq: SeqId, tokens: &[u32], logits: &mut [f32]) -> Result<()> {
        self.gathered(logits, |e, out| e.prefill(seq, tokens, out))
    }

    fn prefill_logits(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        first: usize,
        logits: &mut [f32],
    ) -> Result<()> {
        self.gathered(logits, |e, out| e.prefill_logits(seq, tokens, first, out))
    }

    fn prefill_hidden(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        first: usize,
        hidden: &mut [f32],
    ) -> Result<()> {
        // Every rank ends with the whole hidden state (the last branch's all-reduce).
        let mut bufs = vec![vec![0f32; hidden.len()]; self.world()];
        self.on_all(
            |e, out| e.prefill_hidden(seq, tokens, first, out),
            &mut bufs,
        )?;
        hidden.copy_from_slice(&bufs[0]);
        Ok(())
    }

    fn decode(&mut self, batch: &[DecodeItem], logits: &mut [f32]) -> Result<()> {
        self.gathered(logits, |e, out| e.decode(batch, out))
    }
}
