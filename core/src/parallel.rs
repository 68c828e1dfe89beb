//! Tensor parallelism: a model's matrices split over ranks that exchange partial sums.
//!
//! The split is Megatron-LM's, which vLLM and llama.cpp's row split follow too: each rank
//! keeps a contiguous share of the attention heads (the rows of Q, K and V, the columns of
//! the output projection) and of every feed-forward's width (the rows of gate and up, the
//! columns of down; a Mixture of Experts splits each expert the same way and keeps the
//! whole router), so a branch's operations give each rank a partial sum of the branch's
//! output, which one all-reduce completes before the post-norm and the residual. The LM
//! head is split by vocabulary rows: each rank computes its rows' logits and the executor
//! gathers them. Norms, the embedding lookup and the router run whole on every rank. A
//! bias that follows a split matrix's columns (the output projection's, down's) is added
//! by rank 0 alone, so the all-reduce counts it once.
//!
//! [`shard`] makes one rank's program and config from the whole model's; [`Collective`] is
//! what an executor calls to sum its partials, with [`LocalCollective`] for ranks that are
//! threads of one process (the CPU backend's, and the check of the sharding math in CI).

use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex};

use crate::error::{Error, Result};
use crate::ir::{ModelConfig, TensorView};
use crate::program::{
    Attention, Branch, Experts, FeedForward, FeedForwardBiases, Head, Linear, ModelProgram, Op,
};

/// The communication between the ranks of a tensor-parallel group.
pub trait Collective: Send + Sync {
    /// This rank's index, `0..world()`.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world(&self) -> usize;
    /// Replaces `values` on every rank with the element-wise sum of every rank's `values`
    /// (all the same length), the same bits on every rank. Blocks until every rank has
    /// called it; an error when the group broke (a rank failed) instead of waiting forever.
    fn all_reduce_sum(&self, values: &mut [f32]) -> Result<()>;
}

/// A group of ranks that are threads of one process, summing through shared memory in rank
/// order (so every rank gets the same bits, run after run).
pub struct LocalCollective {
    rank: usize,
    shared: Arc<LocalGroup>,
}

struct LocalGroup {
    world: usize,
    state: Mutex<GroupState>,
    turn: Condvar,
}

#[derive(Default)]
struct GroupState {
    /// Each rank's contribution to the reduction under way.
    parts: Vec<Vec<f32>>,
    /// Ranks that have put in their part of the current round.
    arrived: usize,
    /// Ranks that have read the current round's sum.
    left: usize,
    /// Rounds completed: a rank waits for the number to move on.
    round: u64,
    broken: Option<String>,
}

impl LocalCollective {
    /// The `world` ranks of a new group, rank `i` at index `i`.
    pub fn group(world: usize) -> Result<Vec<LocalCollective>> {
        if world == 0 {
            return Err(Error::InvalidArgument("a group of no ranks".into()));
        }
        let shared = Arc::new(LocalGroup {
            world,
            state: Mutex::new(GroupState {
                parts: vec![Vec::new(); world],
                ..GroupState::default()
            }),
            turn: Condvar::new(),
        });
        Ok((0..world)
            .map(|rank| LocalCollective {
                rank,
                shared: shared.clone(),
            })
            .collect())
    }

    /// Breaks the group: every rank waiting in, or later calling,
    /// [`Collective::all_reduce_sum`] gets an error saying `why` (a rank that failed calls
    /// it so the others do not wait for it). True for the call that broke it.
    pub fn abort(&self, why: &str) -> bool {
        let mut s = self.shared.lock();
        let first = s.broken.is_none();
        if first {
            s.broken = Some(format!("rank {} failed: {why}", self.rank));
        }
        self.shared.turn.notify_all();
        first
    }

    /// Mends a broken group for the next call. Only while no rank is inside
    /// [`Collective::all_reduce_sum`] (the driver, after every rank's call returned).
    pub fn reset(&self) {
        let mut s = self.shared.lock();
        s.broken = None;
        s.arrived = 0;
        s.left = 0;
    }
}

impl LocalGroup {
    fn lock(&self) -> std::sync::MutexGuard<'_, GroupState> {
        // A rank that panicked while holding the lock left the sums half-written: the group
        // is broken either way, which `broken` (set by the driver's abort) reports.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Collective for LocalCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.shared.world
    }

    fn all_reduce_sum(&self, values: &mut [f32]) -> Result<()> {
        let g = &*self.shared;
        if g.world == 1 {
            return Ok(());
        }
        let broken = |why: &str| Error::Backend {
            backend: "tensor parallel".into(),
            message: why.to_string(),
        };
        let mut s = g.lock();
        // Wait until the previous round's readers are done with the parts.
        while s.left != 0 && s.broken.is_none() {
            s = g.turn.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        if let Some(why) = &s.broken {
            return Err(broken(why));
        }
        let round = s.round;
        let part = &mut s.parts[self.rank];
        part.clear();
        part.extend_from_slice(values);
        s.arrived += 1;
        if s.arrived == g.world {
            s.arrived = 0;
            s.left = g.world;
            s.round += 1;
            g.turn.notify_all();
        }
        while s.round == round && s.broken.is_none() {
            s = g.turn.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        if let Some(why) = &s.broken {
            return Err(broken(why));
        }
        if s.parts.iter().any(|p| p.len() != values.len()) {
            s.broken = Some("ranks reduced vectors of different lengths".into());
            g.turn.notify_all();
            return Err(broken("ranks reduced vectors of different lengths"));
        }
        for (i, v) in values.iter_mut().enumerate() {
            *v = s.parts.iter().map(|p| p[i]).sum();
        }
        s.left -= 1;
        if s.left == 0 {
            g.turn.notify_all();
        }
        Ok(())
    }
}

/// One rank's share of a model: the config it runs with (its heads and feed-forward widths)
/// and the program over its slices of the weights.
#[derive(Debug, Clone)]
pub struct Shard {
    pub config: ModelConfig,
    pub program: ModelProgram<TensorView>,
    /// The vocabulary rows whose logits this rank computes.
    pub vocab: Range<usize>,
}

/// `0..n` split into `world` contiguous parts as even as `unit` allows (every boundary a
/// multiple of it): part `rank`.
fn share(n: usize, unit: usize, rank: usize, world: usize) -> Range<usize> {
    let units = n.div_ceil(unit);
    let at = |r: usize| (units * r / world * unit).min(n);
    at(rank)..at(rank + 1)
}

/// Whether `config`'s attention splits over `world` ranks: both its heads and its KV heads
/// divide by it (so `world` is at most the KV heads, which bounds what a caller allocates
/// per rank before [`shard`] looks at the weights).
pub fn check_heads_split(config: &ModelConfig, world: usize) -> Result<()> {
    if world == 0 {
        return Err(Error::InvalidArgument(
            "a tensor-parallel group of no ranks".into(),
        ));
    }
    if config.num_heads % world != 0 || config.num_kv_heads % world != 0 {
        return Err(Error::Unsupported(format!(
            "tensor parallel {world}: the model's {} attention heads and {} KV heads must both divide by {world}",
            config.num_heads, config.num_kv_heads
        )));
    }
    Ok(())
}

/// Rank `rank`'s share of `program` (the whole model's, for `config`) split over `world`
/// ranks, as the module doc says. Refused with the reason when the model does not split
/// that way: heads or KV heads that do not divide by `world`, or a split matrix's columns
/// that would cut its quantisation blocks.
pub fn shard(
    program: &ModelProgram<TensorView>,
    config: &ModelConfig,
    rank: usize,
    world: usize,
) -> Result<Shard> {
    if rank >= world {
        return Err(Error::InvalidArgument(format!(
            "rank {rank} of a tensor-parallel group of {world}"
        )));
    }
    check_heads_split(config, world)?;
    let c = config;
    let hd = c.head_dim;
    let heads = share(c.num_heads, 1, rank, world);
    let kv_heads = share(c.num_kv_heads, 1, rank, world);
    let q_rows = heads.start * hd..heads.end * hd;
    let kv_rows = kv_heads.start * hd..kv_heads.end * hd;
    let first = rank == 0;

    let mut branches = Vec::with_capacity(program.branches.len());
    let mut ffn_width = None;
    let mut expert_width = None;
    for b in &program.branches {
        let mut ops = Vec::with_capacity(b.ops.len());
        for op in &b.ops {
            ops.push(match op {
                Op::Attention(a) => Op::Attention(Attention {
                    layer: a.layer,
                    q: rows_of(&a.q, &q_rows)?,
                    k: rows_of(&a.k, &kv_rows)?,
                    v: rows_of(&a.v, &kv_rows)?,
                    head_norms: a.head_norms.clone(),
                    span: a.span,
                    scale: a.scale,
                    sinks: match &a.sinks {
                        Some(s) => Some(s.slice_vector(s.name(), heads.start, heads.len())?),
                        None => None,
                    },
                    out: columns_of(&a.out, &q_rows, first)?,
                }),
                Op::FeedForward(f) => {
                    let (f, width) = split_ffn(f, c.ffn_size, rank, world)?;
                    ffn_width = Some(width);
                    Op::FeedForward(f)
                }
                Op::Experts(e) => {
                    let width = c.experts.map_or(0, |x| x.ffn_size);
                    let mut experts = Vec::with_capacity(e.experts.len());
                    for f in &e.experts {
                        let (f, w) = split_ffn(f, width, rank, world)?;
                        expert_width = Some(w);
                        experts.push(f);
                    }
                    Op::Experts(Experts {
                        router: e.router.clone(),
                        experts,
                        used: e.used,
                        normalize: e.normalize,
                    })
                }
            });
        }
        branches.push(Branch {
            norm: b.norm.clone(),
            ops,
            post_norm: b.post_norm.clone(),
            scale: b.scale,
        });
    }
    let vocab = share(c.vocab_size, 1, rank, world);
    let head = Head {
        norm: program.head.norm.clone(),
        output: program.head.output.slice_rows(
            program.head.output.name(),
            vocab.start,
            vocab.len(),
        )?,
        logit_scale: program.head.logit_scale,
        vocab_rows: Some(vocab.clone()),
    };
    let mut config = c.clone();
    config.num_heads = heads.len();
    config.num_kv_heads = kv_heads.len();
    if let Some(w) = ffn_width {
        config.ffn_size = w;
    }
    if let (Some(e), Some(w)) = (config.experts.as_mut(), expert_width) {
        e.ffn_size = w;
    }
    Ok(Shard {
        config,
        program: ModelProgram {
            embedding: program.embedding.clone(),
            branches,
            head,
            rope_freqs: program.rope_freqs.clone(),
        },
        vocab,
    })
}

/// A linear layer's output rows `rows` (and its bias's).
fn rows_of(
    l: &Linear<TensorView, TensorView>,
    rows: &Range<usize>,
) -> Result<Linear<TensorView, TensorView>> {
    Ok(Linear {
        weight: l
            .weight
            .slice_rows(l.weight.name(), rows.start, rows.len())?,
        bias: match &l.bias {
            Some(b) => Some(b.slice_vector(b.name(), rows.start, rows.len())?),
            None => None,
        },
    })
}

/// A linear layer's input columns `cols`; its bias stays with the rank that adds it.
fn columns_of(
    l: &Linear<TensorView, TensorView>,
    cols: &Range<usize>,
    keeps_bias: bool,
) -> Result<Linear<TensorView, TensorView>> {
    Ok(Linear {
        weight: l
            .weight
            .slice_columns(l.weight.name(), cols.start, cols.len())?,
        bias: if keeps_bias { l.bias.clone() } else { None },
    })
}

/// A feed-forward's share of its `width` (gate and up rows, down columns), split at
/// multiples of down's block length; the share's width.
fn split_ffn(
    f: &FeedForward<TensorView, TensorView>,
    width: usize,
    rank: usize,
    world: usize,
) -> Result<(FeedForward<TensorView, TensorView>, usize)> {
    let unit = f.down.qtype().block_len();
    let part = share(width, unit, rank, world);
    if part.is_empty() {
        return Err(Error::Unsupported(format!(
            "tensor parallel {world}: a feed-forward of width {width} in {}-value blocks leaves rank {rank} nothing",
            unit
        )));
    }
    let rows = |m: &TensorView| m.slice_rows(m.name(), part.start, part.len());
    let split = FeedForward {
        gate: f.gate.as_ref().map(rows).transpose()?,
        up: rows(&f.up)?,
        down: f
            .down
            .slice_columns(f.down.name(), part.start, part.len())?,
        activation: f.activation,
        biases: match &f.biases {
            Some(b) => Some(FeedForwardBiases {
                gate: match &b.gate {
                    Some(g) => Some(g.slice_vector(g.name(), part.start, part.len())?),
                    None => None,
                },
                up: b.up.slice_vector(b.up.name(), part.start, part.len())?,
                down: if rank == 0 {
                    b.down.clone()
                } else {
                    // The other ranks' share of down's bias is nothing: zeros, so the
                    // program keeps one shape for every rank.
                    TensorView::from_f32(
                        b.down.name(),
                        vec![b.down.elements()],
                        &vec![0.0; b.down.elements()],
                    )?
                },
            }),
            None => None,
        },
    };
    let width = part.len();
    Ok((split, width))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_the_range_on_unit_boundaries() {
        for (n, unit, world) in [
            (64, 1, 4),
            (100, 32, 2),
            (96, 32, 4),
            (8192, 256, 4),
            (7, 1, 2),
        ] {
            let parts: Vec<_> = (0..world).map(|r| share(n, unit, r, world)).collect();
            assert_eq!(parts[0].start, 0);
            assert_eq!(parts[world - 1].end, n);
            for w in parts.windows(2) {
                assert_eq!(w[0].end, w[1].start);
                assert!(w[0].end % unit == 0 || w[0].end == n);
            }
        }
    }

    #[test]
    fn ranks_sum_the_same_bits_round_after_round() {
        for world in [1, 2, 4] {
            let group = LocalCollective::group(world).unwrap();
            let results: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
                let handles: Vec<_> = group
                    .iter()
                    .map(|c| {
                        s.spawn(move || {
                            (0..50)
                                .map(|round| {
                                    let mut v: Vec<f32> = (0..7)
                                        .map(|i| (c.rank() * 1000 + round * 10 + i) as f32 * 0.1)
                                        .collect();
                                    c.all_reduce_sum(&mut v).unwrap();
                                    v
                                })
                                .collect()
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for round in 0..50 {
                let expected: Vec<f32> = (0..7)
                    .map(|i| {
                        (0..world)
                            .map(|r| (r * 1000 + round * 10 + i) as f32 * 0.1)
                            .sum()
                    })
                    .collect();
                for r in &results {
                    assert_eq!(r[round], expected, "world {world} round {round}");
                }
            }
        }
    }

    #[test]
    fn an_aborted_group_frees_its_waiting_ranks() {
        let group = LocalCollective::group(2).unwrap();
        let err = std::thread::scope(|s| {
            let waiter = s.spawn(|| group[1].all_reduce_sum(&mut [1.0, 2.0]));
            std::thread::sleep(std::time::Duration::from_millis(50));
            assert!(group[0].abort("out of memory"));
            waiter.join().unwrap()
        });
        let msg = err.unwrap_err().to_string();
        assert!(msg.contains("rank 0 failed: out of memory"), "{msg}");
        assert!(group[0].all_reduce_sum(&mut [0.0]).is_err());
        assert!(!group[1].abort("later"), "the group was broken already");
        // Mended, the group sums again.
        group[0].reset();
        let sums = std::thread::scope(|s| {
            let a = s.spawn(|| {
                let mut v = [1.0];
                group[0].all_reduce_sum(&mut v).map(|_| v[0])
            });
            let mut v = [2.0];
            let b = group[1].all_reduce_sum(&mut v).map(|_| v[0]);
            (a.join().unwrap(), b)
        });
        assert_eq!((sums.0.unwrap(), sums.1.unwrap()), (3.0, 3.0));
    }
}
