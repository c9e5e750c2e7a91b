//! Next-token choice: greedy (temperature 0), or temperature, then top-k, then top-p (vLLM's
//! order) sampling from a seeded RNG; and the log-probabilities an API reports.
//!
//! Infinite logits: a `-inf` token is never chosen; `+inf` tokens take all the probability,
//! shared evenly when there are several (top-k among them keeps the lowest ids; greedy takes the
//! lowest id). A row of only `-inf` logits, or a NaN logit, is an error.

use std::cmp::Ordering;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::{Error, Result};

/// How tokens are chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 → greedy (argmax, lowest id on ties, as `torch.argmax`).
    pub temperature: f32,
    /// Nucleus: keep the most probable tokens whose mass first reaches `top_p` (1 → all).
    pub top_p: f32,
    /// Keep the `top_k` most probable tokens, ties to the lower id (0 → all).
    pub top_k: usize,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Temperature finite and >= 0, top_p in (0, 1]; every top_k is valid (0 and values of at
    /// least the vocabulary keep every token).
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(Error::Request(format!(
                "temperature must be a finite number >= 0, got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::Request(format!(
                "top_p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// One sequence's sampler (its own RNG stream, so results do not depend on batch composition).
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
}

impl Sampler {
    /// A sampler for stream `stream` (e.g. the prompt's index) of `params.seed`.
    pub fn new(params: SamplingParams, stream: u64) -> Result<Sampler> {
        params.validate()?;
        let mut rng = ChaCha8Rng::seed_from_u64(params.seed);
        rng.set_stream(stream);
        Ok(Sampler { params, rng })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The next token from `logits` \[vocab\] (see the module docs for infinities; NaN, an empty
    /// row or a row of only `-inf` is an error).
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        let max = check_logits("sample", logits)?;
        if self.params.is_greedy() {
            return Ok(argmax(logits));
        }
        let w = Weight::new(max, self.params.temperature);
        let filtered =
            (self.params.top_k > 0 && self.params.top_k < logits.len()) || self.params.top_p < 1.0;
        if !filtered {
            // Every token, in id order: no sorting, no allocation.
            let total: f64 = logits.iter().map(|&l| w.of(l) as f64).sum();
            let u = self.rng.random::<f64>() * total;
            return Ok(draw(
                logits.iter().enumerate().map(|(i, &l)| (i as u32, w.of(l))),
                u,
            ));
        }
        let kept = kept(logits, &self.params, &w);
        let total: f64 = kept.iter().map(|&(_, l)| w.of(l) as f64).sum();
        let u = self.rng.random::<f64>() * total;
        Ok(draw(kept.iter().map(|&(i, l)| (i, w.of(l))), u))
    }
}

/// Unnormalized probability of a logit at a temperature: `exp((l - max) / t)`, or 1 for `+inf`
/// logits (0 for the rest) when the maximum is `+inf`. Never NaN.
struct Weight {
    max: f32,
    t: f32,
}

impl Weight {
    fn new(max: f32, t: f32) -> Weight {
        Weight { max, t }
    }

    fn of(&self, l: f32) -> f32 {
        if self.max == f32::INFINITY {
            if l == f32::INFINITY { 1.0 } else { 0.0 }
        } else {
            // l - max <= 0 (or -inf); an overflow to -inf gives 0.
            ((l - self.max) / self.t).exp()
        }
    }
}

/// Most likely first: larger logit, then lower id (-0 and 0 are one value).
fn by_rank(a: &(u32, f32), b: &(u32, f32)) -> Ordering {
    b.1.partial_cmp(&a.1)
        .unwrap_or(Ordering::Equal)
        .then(a.0.cmp(&b.0))
}

/// The tokens top-k and then top-p keep, as (id, logit) in id order; none of weight 0.
fn kept(logits: &[f32], p: &SamplingParams, w: &Weight) -> Vec<(u32, f32)> {
    let mut c: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .filter(|&(_, &l)| w.of(l) > 0.0)
        .map(|(i, &l)| (i as u32, l))
        .collect();
    if p.top_k > 0 && p.top_k < c.len() {
        c.select_nth_unstable_by(p.top_k - 1, by_rank);
        c.truncate(p.top_k);
    }
    if p.top_p < 1.0 {
        let keep = nucleus(&mut c, p.top_p as f64, w);
        c.truncate(keep);
    }
    c.sort_unstable_by_key(|x| x.0);
    c
}

/// Orders the most likely tokens of `c` first until their mass reaches `top_p` of the whole,
/// and returns how many that is. Sorts in growing chunks (a partial selection, then a sort of
/// the chunk), so a small nucleus costs O(len), not a sort of everything.
fn nucleus(c: &mut [(u32, f32)], top_p: f64, w: &Weight) -> usize {
    let total: f64 = c.iter().map(|&(_, l)| w.of(l) as f64).sum();
    let target = top_p * total;
    let (mut cum, mut done, mut chunk) = (0f64, 0usize, 64usize);
    while done < c.len() {
        let end = done.saturating_add(chunk).min(c.len());
        if end < c.len() {
            c[done..].select_nth_unstable_by(end - done - 1, by_rank);
        }
        c[done..end].sort_unstable_by(by_rank);
        for (i, &(_, l)) in c[done..end].iter().enumerate() {
            cum += w.of(l) as f64;
            if cum >= target {
                return done + i + 1;
            }
        }
        done = end;
        chunk = chunk.saturating_mul(2);
    }
    c.len()
}

/// The token whose share of the cumulative weights holds `u`; rounding past the end gives the
/// last token of nonzero weight (a weight-0 token is never chosen).
fn draw(tokens: impl Iterator<Item = (u32, f32)>, mut u: f64) -> u32 {
    let mut last = 0;
    for (id, p) in tokens {
        if p <= 0.0 {
            continue;
        }
        let p = p as f64;
        if u < p {
            return id;
        }
        u -= p;
        last = id;
    }
    last
}

/// The largest logit, after checking the row: not empty, no NaN, not all `-inf`.
fn check_logits(op: &str, logits: &[f32]) -> Result<f32> {
    if logits.is_empty() {
        return Err(Error::Request(format!("{op}: no logits")));
    }
    if let Some(i) = logits.iter().position(|v| v.is_nan()) {
        return Err(Error::Request(format!("{op}: logit {i} is NaN")));
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return Err(Error::Request(format!(
            "{op}: all {} logits are -inf",
            logits.len()
        )));
    }
    Ok(max)
}

/// Index of the largest value; the lowest index among equals.
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// A token's log-probability and the most likely alternatives, as OpenAI and vLLM report them.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f32,
    /// The `top_n` most likely tokens, most likely first, ties by id.
    pub top: Vec<(u32, f32)>,
}

/// Log-softmax of the raw logits (before temperature; f64 sums of max-subtracted exponentials):
/// `token`'s log-probability and the `top_n` most likely tokens (all of them if fewer). A `-inf`
/// logit has log-probability `-inf`; with `+inf` logits each of them has `-ln(count)` and the
/// rest `-inf`. Errors: an empty row, a NaN, only `-inf`, `token` out of range.
pub fn logprobs(logits: &[f32], token: u32, top_n: usize) -> Result<TokenLogprobs> {
    let max = check_logits("logprobs", logits)?;
    if token as usize >= logits.len() {
        return Err(Error::Request(format!(
            "logprobs: token {token} is out of range for {} logits",
            logits.len()
        )));
    }
    let lp = LogSoftmax::new(logits, max);
    let n = top_n.min(logits.len());
    let mut top = Vec::new();
    if n > 0 {
        let mut all: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l))
            .collect();
        if n < all.len() {
            all.select_nth_unstable_by(n - 1, by_rank);
            all.truncate(n);
        }
        all.sort_unstable_by(by_rank);
        top = all.into_iter().map(|(i, l)| (i, lp.of(l))).collect();
    }
    Ok(TokenLogprobs {
        token,
        logprob: lp.of(logits[token as usize]),
        top,
    })
}

/// Log-softmax of one row, given its maximum.
struct LogSoftmax {
    /// `-ln(count of +inf logits)` when the maximum is `+inf`.
    inf_each: Option<f32>,
    /// Log-sum-exp of the row otherwise.
    lse: f64,
}

impl LogSoftmax {
    fn new(logits: &[f32], max: f32) -> LogSoftmax {
        if max == f32::INFINITY {
            let n = logits.iter().filter(|&&l| l == f32::INFINITY).count();
            return LogSoftmax {
                inf_each: Some(-(n as f64).ln() as f32),
                lse: 0.0,
            };
        }
        let max = max as f64;
        let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
        LogSoftmax {
            inf_each: None,
            lse: max + sum.ln(),
        }
    }

    fn of(&self, l: f32) -> f32 {
        match self.inf_each {
            Some(each) if l == f32::INFINITY => each,
            Some(_) => f32::NEG_INFINITY,
            None => (l as f64 - self.lse) as f32,
        }
    }
}

#[cfg(test)]
mod tests;
