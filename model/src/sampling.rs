//! Token sampling with an exactly specified arithmetic, so that a GPU backend (or a batched run)
//! given the same logits and the same uniform draw picks the same token.
//!
//! # The procedure
//! 1. **Mask**: a token is *allowed* unless it is banned or its logit is `-inf` or NaN. No allowed
//!    token → [`SampleOutcome::NothingAllowed`] (the engine finishes with reason `safety`).
//! 2. **Greedy** (`temperature == 0`): the allowed token with the largest logit; ties → lowest id.
//! 3. Otherwise `s[i] = logit[i] / temperature` (f32 division); `m = max s[i]` over allowed;
//!    `e[i] = exp_f32(s[i] - m)` for allowed tokens and `0` for the others (the kernels' exactly
//!    specified `exp`); `S = sum(e)` with the kernels' 16-lane sum over the whole vocabulary in id
//!    order; `p[i] = e[i] / S`.
//! 4. **Order** allowed tokens by `p` descending, ties by id ascending.
//! 5. **Top-k** (`top_k > 0`): keep the first `top_k` of that order.
//! 6. **Top-p** (`top_p < 1`): walk the order accumulating `c += p[i]` (f32, in order); keep tokens
//!    up to and including the first where `c >= top_p`.
//! 7. **Pick**: `T = Σ p` over the kept tokens, accumulated in order (f32); `r = uniform · T`; walk
//!    the kept tokens accumulating `c += p[i]` and return the first with `r < c`; if rounding
//!    leaves none, the last kept token with `p > 0`.
//!
//! The uniform draw comes from [`sample_uniform`], a counter-based generator: the draw for step
//! `n` of a request depends on `(seed, n)` only, never on batching or on the device.

use zerolayer_kernels::cpu::{CpuKernels, exp_f32};

use crate::dummy::splitmix64;

/// Smallest positive temperature: below it `logit / temperature` can overflow f32 for ordinary
/// logits (|logit| ≲ 100 → 1e8 at 1e-6, far from 3.4e38; 1e-6 keeps a wide margin). Use 0 for
/// greedy decoding.
pub const MIN_POSITIVE_TEMPERATURE: f32 = 1e-6;
/// Largest temperature: past it every distribution is numerically uniform anyway.
pub const MAX_TEMPERATURE: f32 = 1e6;
/// Before sorting, tokens with `p < PREFILTER_MASS / allowed` are set aside; their total mass is
/// below 1%, and if the walk needs them the full order is used (results are identical either way).
const PREFILTER_MASS: f32 = 0.01;

/// Invalid sampling parameters.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    /// Temperature NaN, negative, infinite, or positive but below [`MIN_POSITIVE_TEMPERATURE`].
    #[error(
        "temperature {0} must be 0 (greedy) or within {MIN_POSITIVE_TEMPERATURE}..={MAX_TEMPERATURE}"
    )]
    InvalidTemperature(f32),
    /// `top_p` outside `(0, 1]`.
    #[error("top_p {0} must be in (0, 1]")]
    InvalidTopP(f32),
    /// A banned id is outside the vocabulary.
    #[error("banned token {token} is outside the vocabulary (size {vocab_size})")]
    BannedOutOfRange {
        /// The id.
        token: u32,
        /// Vocabulary size.
        vocab_size: usize,
    },
}

/// Validated sampling parameters of one request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy; otherwise the softmax temperature.
    temperature: f32,
    /// Keep the `top_k` most likely tokens (0 = no limit).
    top_k: u32,
    /// Nucleus mass in `(0, 1]` (1 = no limit).
    top_p: f32,
    /// Seed of the request's uniform draws ([`sample_uniform`]).
    seed: u64,
}

impl SamplingParams {
    /// Validates and builds parameters.
    pub fn new(temperature: f32, top_k: u32, top_p: f32, seed: u64) -> Result<Self, SamplingError> {
        let t_ok = temperature == 0.0
            || (MIN_POSITIVE_TEMPERATURE..=MAX_TEMPERATURE).contains(&temperature);
        if !t_ok {
            return Err(SamplingError::InvalidTemperature(temperature));
        }
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(SamplingError::InvalidTopP(top_p));
        }
        Ok(SamplingParams {
            temperature,
            top_k,
            top_p,
            seed,
        })
    }

    /// Greedy decoding (temperature 0).
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }

    /// Softmax temperature (0 = greedy).
    pub fn temperature(&self) -> f32 {
        self.temperature
    }

    /// Top-k limit (0 = none).
    pub fn top_k(&self) -> u32 {
        self.top_k
    }

    /// Top-p mass (1 = none).
    pub fn top_p(&self) -> f32 {
        self.top_p
    }

    /// Seed of the uniform draws.
    pub fn seed(&self) -> u64 {
        self.seed
    }
}

/// Uniform draw in `[0, 1)` for step `step` of a request seeded with `seed`:
/// `(splitmix64(seed ^ splitmix64(step)) >> 40) · 2⁻²⁴` (24 bits, exact in f32).
pub fn sample_uniform(seed: u64, step: u64) -> f32 {
    (splitmix64(seed ^ splitmix64(step)) >> 40) as f32 * (1.0 / (1u32 << 24) as f32)
}

/// What sampling needs besides the logits.
#[derive(Clone, Copy, Debug)]
pub struct SampleInput<'a> {
    /// The request's parameters.
    pub params: &'a SamplingParams,
    /// The draw for this step, normally `sample_uniform(params.seed(), step)`.
    pub uniform: f32,
    /// Token ids that must not be produced (safety mask).
    pub banned: &'a [u32],
}

/// Result of sampling one token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SampleOutcome {
    /// The chosen token.
    Token(u32),
    /// Every token was masked (finish reason `safety`).
    NothingAllowed,
}

/// Sampling with reusable scratch buffers (no allocation per token once warmed up).
#[derive(Debug, Default)]
pub struct Sampler {
    /// `e[i]`, then `p[i]`, per vocabulary entry.
    probs: Vec<f32>,
    /// Banned flags per vocabulary entry (reset after each call).
    banned: Vec<bool>,
    /// Candidate ids being ordered.
    order: Vec<u32>,
}

impl Sampler {
    /// A sampler with empty scratch (grown on first use).
    pub fn new() -> Self {
        Self::default()
    }

    /// Samples one token from `logits` (one row of the vocabulary) following the module's
    /// procedure.
    pub fn sample(
        &mut self,
        logits: &[f32],
        input: &SampleInput<'_>,
    ) -> Result<SampleOutcome, SamplingError> {
        let vocab = logits.len();
        self.banned.clear();
        self.banned.resize(vocab, false);
        for &b in input.banned {
            match self.banned.get_mut(b as usize) {
                Some(flag) => *flag = true,
                None => {
                    return Err(SamplingError::BannedOutOfRange {
                        token: b,
                        vocab_size: vocab,
                    });
                }
            }
        }
        let banned = &self.banned;
        let allowed = |i: usize| !banned[i] && logits[i] > f32::NEG_INFINITY;
        let params = input.params;
        if params.temperature == 0.0 {
            let mut best: Option<usize> = None;
            for i in (0..vocab).filter(|&i| allowed(i)) {
                if best.is_none_or(|b| logits[i] > logits[b]) {
                    best = Some(i);
                }
            }
            return Ok(best.map_or(SampleOutcome::NothingAllowed, |b| {
                SampleOutcome::Token(b as u32)
            }));
        }
        let t = params.temperature;
        let mut max = f32::NEG_INFINITY;
        let mut n_allowed = 0usize;
        for i in (0..vocab).filter(|&i| allowed(i)) {
            max = max.max(logits[i] / t);
            n_allowed += 1;
        }
        if n_allowed == 0 {
            return Ok(SampleOutcome::NothingAllowed);
        }
        self.probs.clear();
        self.probs.extend((0..vocab).map(|i| {
            if allowed(i) {
                exp_f32(logits[i] / t - max)
            } else {
                0.0
            }
        }));
        let s = CpuKernels::best().sum(&self.probs);
        for p in &mut self.probs {
            *p /= s;
        }
        // Candidates above the prefilter threshold first; the full order only if needed.
        let threshold = PREFILTER_MASS / n_allowed as f32;
        for full in [false, true] {
            self.order.clear();
            let probs = &self.probs;
            self.order.extend(
                (0..vocab)
                    .filter(|&i| allowed(i) && (full || probs[i] >= threshold))
                    .map(|i| i as u32),
            );
            let by_prob = |a: &u32, b: &u32| {
                probs[*b as usize]
                    .total_cmp(&probs[*a as usize])
                    .then(a.cmp(b))
            };
            let k = params.top_k as usize;
            if k > 0 && k < self.order.len() {
                self.order.select_nth_unstable_by(k - 1, by_prob);
                self.order.truncate(k);
            }
            self.order.sort_unstable_by(by_prob);
            let complete = full || k > 0 && self.order.len() == k;
            // Top-p cut.
            let mut kept = self.order.len();
            if params.top_p < 1.0 {
                let mut c = 0.0f32;
                let cut = self.order.iter().position(|&i| {
                    c += probs[i as usize];
                    c >= params.top_p
                });
                match cut {
                    Some(pos) => kept = pos + 1,
                    None if !complete => continue,
                    None => {}
                }
            } else if !complete {
                // Without a cut the pick may need every token; use the full order.
                continue;
            }
            let kept_ids = &self.order[..kept];
            let total = kept_ids.iter().fold(0.0f32, |c, &i| c + probs[i as usize]);
            let r = input.uniform * total;
            let mut c = 0.0f32;
            for &i in kept_ids {
                c += probs[i as usize];
                if r < c {
                    return Ok(SampleOutcome::Token(i));
                }
            }
            let last = kept_ids
                .iter()
                .rev()
                .find(|&&i| probs[i as usize] > 0.0)
                .or(kept_ids.first());
            // Invariant: at least one token is allowed, and the most likely one has p > 0.
            return Ok(SampleOutcome::Token(*last.expect("kept set is non-empty")));
        }
        unreachable!("the full pass always returns")
    }
}
