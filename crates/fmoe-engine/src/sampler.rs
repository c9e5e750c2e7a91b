//! Next-token choice: greedy (temperature 0), or temperature + top-p sampling from a seeded RNG.

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
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
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

    /// The next token from `logits` \[vocab\]. A NaN logit is an error.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        if logits.is_empty() {
            return Err(Error::Request("no logits to sample from".into()));
        }
        if let Some(i) = logits.iter().position(|v| v.is_nan()) {
            return Err(Error::Request(format!("logit {i} is NaN")));
        }
        if self.params.is_greedy() {
            return Ok(argmax(logits));
        }
        let t = self.params.temperature;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut probs: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, ((l - max) / t).exp()))
            .collect();
        let total: f32 = probs.iter().map(|p| p.1).sum();
        probs.iter_mut().for_each(|p| p.1 /= total);
        // Most probable first; ties by id so the order is deterministic.
        probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut keep = probs.len();
        if self.params.top_p < 1.0 {
            let mut cum = 0f32;
            for (i, p) in probs.iter().enumerate() {
                cum += p.1;
                if cum >= self.params.top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        let kept = &probs[..keep];
        let mass: f32 = kept.iter().map(|p| p.1).sum();
        let mut u = self.rng.random::<f32>() * mass;
        for p in kept {
            if u < p.1 {
                return Ok(p.0);
            }
            u -= p.1;
        }
        Ok(kept[kept.len() - 1].0)
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_is_argmax_with_first_index_on_ties() {
        let mut s = Sampler::new(SamplingParams::default(), 0).unwrap();
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]).unwrap(), 1);
        assert!(s.sample(&[0.0, f32::NAN]).is_err());
    }

    #[test]
    fn top_p_keeps_the_nucleus_and_seeds_reproduce() {
        let params = SamplingParams {
            temperature: 1.0,
            top_p: 0.5,
            seed: 7,
        };
        // Token 2 alone holds > 50%: top-p 0.5 always picks it.
        let logits = [0.0, 1.0, 3.0, 0.5];
        let mut s = Sampler::new(params, 0).unwrap();
        assert!((0..50).all(|_| s.sample(&logits).unwrap() == 2));
        // Full sampling visits several tokens, and the same seed repeats the sequence.
        let p = SamplingParams {
            top_p: 1.0,
            ..params
        };
        let draw = |stream| {
            let mut s = Sampler::new(p, stream).unwrap();
            (0..64)
                .map(|_| s.sample(&logits).unwrap())
                .collect::<Vec<_>>()
        };
        let a = draw(0);
        assert_eq!(a, draw(0));
        assert_ne!(a, draw(1));
        assert!(a.iter().any(|&t| t != 2));
    }

    #[test]
    fn bad_parameters_are_rejected() {
        for (t, p) in [(-1.0, 1.0), (f32::NAN, 1.0), (1.0, 0.0), (1.0, 1.5)] {
            let params = SamplingParams {
                temperature: t,
                top_p: p,
                seed: 0,
            };
            assert!(Sampler::new(params, 0).is_err(), "{t} {p}");
        }
    }
}
