//! Embeddings: a text's final hidden states (after the last layer and the output norm,
//! [`LayerExecutor::prefill_hidden`](kiln_core::LayerExecutor::prefill_hidden)) pooled into
//! one vector, L2-normalised unless asked otherwise — what a retrieval pipeline stores and
//! compares by cosine.

use kiln_core::{Error, HiddenRequest, LayerExecutor, Result, SeqId};

use crate::engine::{Engine, Model, ModelFile};

/// How a text's hidden states become one vector (llama.cpp's `pooling_type` values 1–3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// The mean over every token.
    Mean,
    /// The first token's (a BERT-style `[CLS]`).
    Cls,
    /// The last token's: under causal attention the only one that has seen the whole
    /// text (what decoder embedding models such as Qwen3-Embedding use).
    Last,
}

impl Pooling {
    /// `mean`, `cls` or `last`.
    pub fn parse(name: &str) -> Result<Pooling> {
        match name.to_ascii_lowercase().as_str() {
            "mean" => Ok(Pooling::Mean),
            "cls" => Ok(Pooling::Cls),
            "last" => Ok(Pooling::Last),
            other => Err(Error::InvalidArgument(format!(
                "pooling {other:?}: mean, cls or last"
            ))),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Pooling::Mean => "mean",
            Pooling::Cls => "cls",
            Pooling::Last => "last",
        }
    }

    /// The pooling a GGUF file names (`{arch}.pooling_type`): `None` where it names none
    /// (0, or no key: a generative model); a rank head (4) or an unknown value is an error.
    pub fn of_model(model: &Model) -> Result<Option<Pooling>> {
        let ModelFile::Gguf(file) = &model.file else {
            return Ok(None);
        };
        let Some(arch) = file.get_str("general.architecture") else {
            return Ok(None);
        };
        match file.get_u64(&format!("{arch}.pooling_type")) {
            None | Some(0) => Ok(None),
            Some(1) => Ok(Some(Pooling::Mean)),
            Some(2) => Ok(Some(Pooling::Cls)),
            Some(3) => Ok(Some(Pooling::Last)),
            Some(4) => Err(Error::Unsupported(
                "a reranking model (pooling_type 4, rank) gives scores, not embeddings".into(),
            )),
            Some(other) => Err(Error::Format(format!(
                "{arch}.pooling_type {other} is not a known pooling (0 to 4)"
            ))),
        }
    }

    /// Which rows a pooling reads: from this one (of `len`) on.
    fn first_row(self, len: usize) -> usize {
        match self {
            Pooling::Mean | Pooling::Cls => 0,
            Pooling::Last => len - 1,
        }
    }
}

/// One vector from `rows` hidden states of `width` values (rows from the pooling's
/// [`Pooling::first_row`] on), accumulated in f64.
fn pool(hidden: &[f32], width: usize, pooling: Pooling) -> Vec<f32> {
    let rows = hidden.len() / width;
    match pooling {
        Pooling::Cls => hidden[..width].to_vec(),
        Pooling::Last => hidden[(rows - 1) * width..].to_vec(),
        Pooling::Mean => {
            let mut sum = vec![0f64; width];
            for row in hidden.chunks_exact(width) {
                for (s, &v) in sum.iter_mut().zip(row) {
                    *s += v as f64;
                }
            }
            sum.iter().map(|&s| (s / rows as f64) as f32).collect()
        }
    }
}

/// `v` scaled to unit length (left as it is when it is all zeros).
pub fn l2_normalize(v: &mut [f32]) {
    let norm = v
        .iter()
        .map(|&x| (x as f64) * (x as f64))
        .sum::<f64>()
        .sqrt();
    if norm > 0.0 {
        v.iter_mut().for_each(|x| *x = (*x as f64 / norm) as f32);
    }
}

impl Engine {
    /// The embeddings of several texts, in order, through shared passes: as many texts at
    /// once as the executor has free sequences (`LoadOptions::max_sequences`), each
    /// sequence freed after its pass, whatever happens.
    ///
    /// # Errors
    /// As [`Engine::embed`], for the first text that has one.
    pub fn embed_many(
        &mut self,
        inputs: &[&[u32]],
        pooling: Pooling,
        normalize: bool,
    ) -> Result<Vec<Vec<f32>>> {
        let exec = self.executor();
        let mut out = Vec::with_capacity(inputs.len());
        let mut rest = inputs;
        while !rest.is_empty() {
            let mut seqs = Vec::new();
            while seqs.len() < rest.len() {
                match exec.new_sequence() {
                    Ok(seq) => seqs.push(seq),
                    Err(e) if seqs.is_empty() => return Err(e),
                    Err(_) => break,
                }
            }
            let n = seqs.len();
            let run = embed_batch_on(exec, &seqs, &rest[..n], pooling, normalize);
            for seq in seqs {
                exec.free_sequence(seq)?;
            }
            out.extend(run?);
            rest = &rest[n..];
        }
        Ok(out)
    }

    /// The embedding of `tokens`: run in a sequence of its own (freed afterwards, whatever
    /// happens), its final hidden states pooled, then L2-normalised when `normalize`.
    ///
    /// # Errors
    /// `InvalidArgument` for no tokens or ids outside the vocabulary, `ContextExceeded`
    /// for a text as long as the context, `Unsupported` from a backend that gives no
    /// hidden states (a GPU backend without cuBLAS), and what the executor reports.
    pub fn embed(&mut self, tokens: &[u32], pooling: Pooling, normalize: bool) -> Result<Vec<f32>> {
        embed_on(self.executor(), tokens, pooling, normalize)
    }
}

/// The embeddings of several texts, in order, through shared passes
/// ([`LayerExecutor::prefill_hidden_batch`]): `seqs` free sequences, one a text (the
/// caller takes them and frees them after, whatever happens).
pub fn embed_batch_on(
    exec: &mut dyn LayerExecutor,
    seqs: &[SeqId],
    inputs: &[&[u32]],
    pooling: Pooling,
    normalize: bool,
) -> Result<Vec<Vec<f32>>> {
    let context = exec.max_context();
    for tokens in inputs {
        if tokens.is_empty() {
            return Err(Error::InvalidArgument(
                "an embedding needs at least one token".into(),
            ));
        }
        if tokens.len() >= context {
            return Err(Error::ContextExceeded {
                tokens: tokens.len(),
                context,
            });
        }
    }
    if seqs.len() != inputs.len() {
        return Err(Error::InvalidArgument(format!(
            "{} sequences for {} texts to embed",
            seqs.len(),
            inputs.len()
        )));
    }
    let width = exec.config().hidden_size;
    let items: Vec<HiddenRequest<'_>> = seqs
        .iter()
        .zip(inputs)
        .map(|(&seq, tokens)| HiddenRequest {
            seq,
            tokens,
            first: pooling.first_row(tokens.len()),
        })
        .collect();
    let rows: usize = items.iter().map(|i| i.tokens.len() - i.first).sum();
    let mut hidden = vec![0f32; rows * width];
    exec.prefill_hidden_batch(&items, &mut hidden)?;
    if hidden.iter().any(|v| !v.is_finite()) {
        return Err(Error::NonFiniteLogits { step: 0 });
    }
    let mut out = Vec::with_capacity(items.len());
    let mut at = 0;
    for item in &items {
        let n = (item.tokens.len() - item.first) * width;
        let mut v = pool(&hidden[at..at + n], width, pooling);
        at += n;
        if normalize {
            l2_normalize(&mut v);
        }
        out.push(v);
    }
    Ok(out)
}

/// [`Engine::embed`] on an executor (the engine thread's scheduler calls it between steps;
/// it needs one free sequence slot).
pub fn embed_on(
    exec: &mut dyn LayerExecutor,
    tokens: &[u32],
    pooling: Pooling,
    normalize: bool,
) -> Result<Vec<f32>> {
    let mut v = embed_in_new_sequences(exec, &[tokens], pooling, normalize)?;
    Ok(v.pop().expect("one embedding for one text"))
}

/// [`embed_batch_on`] with a sequence taken for each text and every one freed after the
/// pass, whatever happens (the scheduler's embedding turn; it needs that many free slots).
pub fn embed_in_new_sequences(
    exec: &mut dyn LayerExecutor,
    inputs: &[&[u32]],
    pooling: Pooling,
    normalize: bool,
) -> Result<Vec<Vec<f32>>> {
    let mut seqs = Vec::with_capacity(inputs.len());
    let taken = (0..inputs.len()).try_for_each(|_| {
        seqs.push(exec.new_sequence()?);
        Ok(())
    });
    let run = taken.and_then(|()| embed_batch_on(exec, &seqs, inputs, pooling, normalize));
    let freed = seqs.iter().try_for_each(|&seq| exec.free_sequence(seq));
    let vectors = run?;
    freed?;
    Ok(vectors)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pools_and_normalises() {
        let hidden = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        assert_eq!(pool(&hidden, 2, Pooling::Mean), vec![3.0, 4.0]);
        assert_eq!(pool(&hidden, 2, Pooling::Cls), vec![1.0, 2.0]);
        assert_eq!(pool(&hidden[4..], 2, Pooling::Last), vec![5.0, 6.0]);
        let mut v = vec![3.0, 4.0];
        l2_normalize(&mut v);
        assert_eq!(v, vec![0.6, 0.8]);
        let mut zero = vec![0.0; 3];
        l2_normalize(&mut zero);
        assert_eq!(zero, vec![0.0; 3]);
        assert_eq!(Pooling::parse("LAST").unwrap(), Pooling::Last);
        assert!(Pooling::parse("max").is_err());
    }
}
