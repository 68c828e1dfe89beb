//! Token sampling: the reference host implementation of every knob a backend may also
//! implement on its device.
//!
//! Order of operations (as llama.cpp's default chain): logit bias → repetition penalty →
//! top-k → temperature → top-p → min-p → draw. Temperature 0 is greedy (argmax, lowest id
//! on ties).

use std::collections::VecDeque;

/// Sampling settings for one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches p; 1.0 keeps all.
    pub top_p: f32,
    /// Drop tokens less likely than min_p × the most likely one; 0 keeps all.
    pub min_p: f32,
    /// Divide positive logits (multiply negative ones) of recent tokens by this; 1.0 is off.
    pub repeat_penalty: f32,
    /// How many recent tokens the penalty looks at.
    pub repeat_last_n: usize,
    pub seed: u64,
    /// Added to the logits of these token ids before anything else (OpenAI's
    /// `logit_bias`); ids outside the vocabulary are ignored.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 0,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            ..Default::default()
        }
    }
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// Checks every setting lies in its range: temperature finite and ≥ 0, top-p and min-p
    /// in [0, 1], repeat penalty finite and > 0, every logit bias finite. A typed error
    /// names the setting.
    pub fn validate(&self) -> crate::Result<()> {
        let bad = |what: &str, v: f32, range: &str| {
            Err(crate::Error::InvalidArgument(format!(
                "{what} {v} is outside {range}"
            )))
        };
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad("temperature", self.temperature, "[0, ∞)");
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            return bad("top-p", self.top_p, "[0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min-p", self.min_p, "[0, 1]");
        }
        if !self.repeat_penalty.is_finite() || self.repeat_penalty <= 0.0 {
            return bad("repeat penalty", self.repeat_penalty, "(0, ∞)");
        }
        if let Some(&(t, b)) = self.logit_bias.iter().find(|(_, b)| !b.is_finite()) {
            return bad(&format!("logit bias of token {t}"), b, "(-∞, ∞)");
        }
        Ok(())
    }
}

/// A small, fast, seedable generator (SplitMix64); the same seed gives the same draws on
/// every backend.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    /// The generator's whole state: `Rng::new(r.state())` continues exactly where `r` is.
    pub fn state(&self) -> u64 {
        self.0
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// One sequence's sampler: settings, random state and the recent tokens the repetition
/// penalty looks at.
#[derive(Debug, Clone)]
pub struct Sampler {
    pub params: SamplingParams,
    pub rng: Rng,
    recent: VecDeque<u32>,
    /// Scratch for candidate (id, logit) pairs, kept to avoid per-token allocation.
    candidates: Vec<(u32, f32)>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = Rng::new(params.seed);
        Sampler {
            params,
            rng,
            recent: VecDeque::new(),
            candidates: Vec::new(),
        }
    }

    /// Records a token of the context (prompt or generated) for the repetition penalty.
    pub fn accept(&mut self, token: u32) {
        if self.params.repeat_last_n == 0 {
            return;
        }
        if self.recent.len() == self.params.repeat_last_n {
            self.recent.pop_front();
        }
        self.recent.push_back(token);
    }

    pub fn recent(&self) -> impl Iterator<Item = u32> + '_ {
        self.recent.iter().copied()
    }

    /// Picks the next token from `logits` (modified in place by the bias and the penalty)
    /// and records it: [`Sampler::adjust`] then [`Sampler::pick`].
    pub fn sample(&mut self, logits: &mut [f32]) -> u32 {
        self.adjust(logits);
        self.pick(logits)
    }

    /// The logit bias, then the repetition penalty, applied to `logits` in place: what
    /// `sample` does before it draws. For callers that read the adjusted distribution
    /// (log-probabilities) before [`Sampler::pick`].
    pub fn adjust(&self, logits: &mut [f32]) {
        for &(t, bias) in &self.params.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += bias;
            }
        }
        self.apply_repeat_penalty(logits);
    }

    /// Draws the next token from logits [`Sampler::adjust`] has already been applied to,
    /// and records it.
    pub fn pick(&mut self, logits: &[f32]) -> u32 {
        let token = if self.params.is_greedy() {
            argmax(logits)
        } else {
            self.draw(logits)
        };
        self.accept(token);
        token
    }

    fn apply_repeat_penalty(&self, logits: &mut [f32]) {
        let penalty = self.params.repeat_penalty;
        if penalty == 1.0 {
            return;
        }
        let mut seen: Vec<u32> = self.recent.iter().copied().collect();
        seen.sort_unstable();
        seen.dedup();
        for t in seen {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = if *l > 0.0 { *l / penalty } else { *l * penalty };
            }
        }
    }

    fn draw(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        let c = &mut self.candidates;
        c.clear();
        if p.top_k > 0 && p.top_k < logits.len() {
            top_k_candidates(logits, p.top_k, c);
        } else {
            c.extend(
                logits
                    .iter()
                    .enumerate()
                    .filter(|(_, l)| !l.is_nan())
                    .map(|(i, &l)| (i as u32, l)),
            );
        }
        // A logit of −∞ is a token ruled out (a grammar's mask, a ban): never a candidate,
        // not even the fallback pick when rounding leaves the draw past the last one.
        c.retain(|x| x.1 > f32::NEG_INFINITY);
        if c.is_empty() {
            return 0;
        }
        let by_logit_desc =
            |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        c.sort_unstable_by(by_logit_desc);
        // Softmax at temperature, in place: logits become probabilities.
        let max = c[0].1;
        let mut sum = 0.0f32;
        for x in c.iter_mut() {
            x.1 = ((x.1 - max) / p.temperature).exp();
            sum += x.1;
        }
        for x in c.iter_mut() {
            x.1 /= sum;
        }
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let keep = c.iter().position(|x| {
                acc += x.1;
                acc >= p.top_p
            });
            c.truncate(keep.map_or(c.len(), |i| i + 1));
        }
        if p.min_p > 0.0 {
            let floor = c[0].1 * p.min_p;
            let keep = c.iter().take_while(|x| x.1 >= floor).count().max(1);
            c.truncate(keep);
        }
        let total: f32 = c.iter().map(|x| x.1).sum();
        let mut r = self.rng.next_f32() * total;
        for &(id, prob) in c.iter() {
            if r < prob {
                return id;
            }
            r -= prob;
        }
        c.last().map_or(0, |x| x.0)
    }
}

/// The `k` largest logits (NaN skipped; the lower id wins a tie) into `out`, unordered, in
/// one pass with a heap of `k`: on a 128k vocabulary almost every logit is one comparison
/// with the heap's worst, several times faster than selecting over all of them.
fn top_k_candidates(logits: &[f32], k: usize, out: &mut Vec<(u32, f32)>) {
    use std::cmp::Ordering;
    use std::collections::BinaryHeap;
    /// Ordered so that the heap's top is the worst kept candidate: the lowest logit, and
    /// of equal logits the highest id.
    struct Worst(u32, f32);
    impl Ord for Worst {
        fn cmp(&self, o: &Self) -> Ordering {
            o.1.total_cmp(&self.1).then(self.0.cmp(&o.0))
        }
    }
    impl PartialOrd for Worst {
        fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
            Some(self.cmp(o))
        }
    }
    impl PartialEq for Worst {
        fn eq(&self, o: &Self) -> bool {
            self.cmp(o) == Ordering::Equal
        }
    }
    impl Eq for Worst {}
    let mut heap: BinaryHeap<Worst> = BinaryHeap::with_capacity(k + 1);
    for (i, &l) in logits.iter().enumerate() {
        if l.is_nan() {
            continue;
        }
        if heap.len() < k {
            heap.push(Worst(i as u32, l));
        } else if let Some(mut worst) = heap.peek_mut() {
            // Ids come in ascending order, so an equal logit never displaces a kept one.
            if l.total_cmp(&worst.1) == Ordering::Greater {
                *worst = Worst(i as u32, l);
            }
        }
    }
    out.extend(heap.into_vec().into_iter().map(|w| (w.0, w.1)));
}

/// Index of the largest logit; the lowest index wins ties, NaN never wins.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_val = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_val {
            best = i;
            best_val = v;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_argmax_and_ignores_nan() {
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&mut [0.1, f32::NAN, 3.0, 3.0, -1.0]), 2);
    }

    #[test]
    fn top_k_one_is_greedy_at_any_temperature() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 5.0,
            top_k: 1,
            ..Default::default()
        });
        for _ in 0..50 {
            assert_eq!(s.sample(&mut [0.0, 2.0, 1.9, -3.0]), 1);
        }
    }

    #[test]
    fn same_seed_same_tokens_and_distribution_follows_softmax() {
        let params = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 7,
            ..Default::default()
        };
        let logits = [0.0f32, (2.0f32).ln(), (5.0f32).ln()]; // probabilities 1/8, 2/8, 5/8
        let run = |p: &SamplingParams| {
            let mut s = Sampler::new(p.clone());
            (0..8000)
                .map(|_| s.sample(&mut logits.clone()))
                .collect::<Vec<_>>()
        };
        let a = run(&params);
        assert_eq!(a, run(&params));
        let freq = |t| a.iter().filter(|&&x| x == t).count() as f32 / a.len() as f32;
        assert!((freq(0) - 0.125).abs() < 0.02, "{}", freq(0));
        assert!((freq(2) - 0.625).abs() < 0.02, "{}", freq(2));
    }

    #[test]
    fn a_token_at_minus_infinity_is_never_drawn() {
        // One allowed token among ruled-out ones, with every cut off and a hot temperature:
        // only it may come out, whether top-k keeps the ruled-out ones or not.
        let mut logits = vec![f32::NEG_INFINITY; 64];
        logits[37] = -20.0;
        for top_k in [0, 8, 40] {
            let mut s = Sampler::new(SamplingParams {
                temperature: 2.0,
                top_k,
                top_p: 1.0,
                min_p: 0.0,
                seed: 3,
                ..Default::default()
            });
            for _ in 0..200 {
                assert_eq!(s.sample(&mut logits.clone()), 37, "top_k {top_k}");
            }
        }
    }

    #[test]
    fn top_p_and_min_p_cut_the_tail() {
        let logits = [10.0f32, 9.0, 0.0, -5.0];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.5,
            min_p: 0.0,
            seed: 1,
            ..Default::default()
        });
        for _ in 0..200 {
            assert_eq!(
                s.sample(&mut logits.clone()),
                0,
                "top-p 0.5 keeps only the first token"
            );
        }
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.2,
            seed: 1,
            ..Default::default()
        });
        for _ in 0..500 {
            assert!(
                s.sample(&mut logits.clone()) < 2,
                "min-p 0.2 drops tokens 2 and 3"
            );
        }
    }

    #[test]
    fn top_k_heap_keeps_what_a_full_selection_keeps() {
        // Fresh random rows with many exact ties, NaNs and infinities: the heap keeps the
        // same set as sorting every candidate (the lower id winning each tie).
        let mut rng = Rng::new(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64,
        );
        for case in 0..300 {
            let n = 1 + (rng.next_u64() % 500) as usize;
            let row: Vec<f32> = (0..n)
                .map(|_| match rng.next_u64() % 10 {
                    0 => f32::NAN,
                    1 => f32::NEG_INFINITY,
                    2 => f32::INFINITY,
                    3 => -0.0,
                    _ => (rng.next_u64() % 7) as f32 - 3.0,
                })
                .collect();
            let k = 1 + (rng.next_u64() % n as u64) as usize;
            let mut want: Vec<(u32, f32)> = row
                .iter()
                .enumerate()
                .filter(|(_, l)| !l.is_nan())
                .map(|(i, &l)| (i as u32, l))
                .collect();
            want.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            want.truncate(k);
            let mut got = Vec::new();
            top_k_candidates(&row, k, &mut got);
            got.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let ids = |v: &[(u32, f32)]| v.iter().map(|x| x.0).collect::<Vec<_>>();
            assert_eq!(ids(&got), ids(&want), "case {case}: n {n}, k {k}");
        }
    }

    #[test]
    fn logit_bias_comes_first_and_ignores_ids_outside_the_vocabulary() {
        let params = SamplingParams {
            logit_bias: vec![(0, -100.0), (2, 5.0), (99, 100.0)],
            ..SamplingParams::greedy()
        };
        let mut s = Sampler::new(params);
        let mut row = [3.0f32, 2.0, -1.0];
        assert_eq!(s.sample(&mut row), 2);
        assert_eq!(row, [-97.0, 2.0, 4.0]);
        // adjust + pick is sample.
        let mut row = [3.0f32, 2.0, -1.0];
        s.adjust(&mut row);
        assert_eq!(s.pick(&row), 2);
        let bad = SamplingParams {
            logit_bias: vec![(1, f32::NAN)],
            ..Default::default()
        };
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("logit bias of token 1"));
    }

    #[test]
    fn repetition_penalty_discourages_recent_tokens() {
        let mut s = Sampler::new(SamplingParams {
            repeat_penalty: 2.0,
            ..SamplingParams::greedy()
        });
        s.accept(0);
        assert_eq!(s.sample(&mut [3.0, 2.0]), 1, "3/2 < 2");
        let mut s = Sampler::new(SamplingParams {
            repeat_penalty: 2.0,
            repeat_last_n: 1,
            ..SamplingParams::greedy()
        });
        s.accept(0);
        s.accept(1);
        assert_eq!(
            s.sample(&mut [3.0, 2.0]),
            0,
            "token 0 fell out of the window"
        );
    }
}

#[cfg(test)]
mod validate_tests {
    use super::SamplingParams;

    #[test]
    fn out_of_range_settings_are_refused_by_name() {
        let ok = SamplingParams::default();
        assert!(ok.validate().is_ok());
        let cases: [(&str, SamplingParams); 8] = [
            (
                "temperature",
                SamplingParams {
                    temperature: -0.5,
                    ..ok.clone()
                },
            ),
            (
                "temperature",
                SamplingParams {
                    temperature: f32::NAN,
                    ..ok.clone()
                },
            ),
            (
                "temperature",
                SamplingParams {
                    temperature: f32::INFINITY,
                    ..ok.clone()
                },
            ),
            (
                "top-p",
                SamplingParams {
                    top_p: 1.5,
                    ..ok.clone()
                },
            ),
            (
                "top-p",
                SamplingParams {
                    top_p: f32::NAN,
                    ..ok.clone()
                },
            ),
            (
                "min-p",
                SamplingParams {
                    min_p: -0.1,
                    ..ok.clone()
                },
            ),
            (
                "repeat penalty",
                SamplingParams {
                    repeat_penalty: -1.0,
                    ..ok.clone()
                },
            ),
            (
                "repeat penalty",
                SamplingParams {
                    repeat_penalty: 0.0,
                    ..ok.clone()
                },
            ),
        ];
        for (name, p) in cases {
            let err = p.validate().expect_err(name).to_string();
            assert!(err.contains(name), "{err}");
        }
    }
}
