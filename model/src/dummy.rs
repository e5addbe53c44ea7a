//! Deterministic dummy weights for named configurations (like vLLM's dummy load format).
//!
//! Every value is a pure function of `(seed, tensor index, element index)` so that a CUDA kernel
//! can generate the identical model on the device without a host copy:
//!
//! - tensor index: `0` token embedding; `1 + 9·l + j` for layer `l` and `j` the position of the
//!   tensor in `rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3`; `1 + 9·L` final norm; `2 + 9·L`
//!   untied classifier. Elements are numbered in row-major order inside a tensor.
//! - norm gains (`rms_att`, `rms_ffn`, final norm) are exactly `1.0`;
//! - every other value is `dummy_weight(seed, tensor, element) * dummy_scale(fan_in)` (one f32
//!   multiply), where `fan_in` is the row length (`dim`, or `hidden_dim` for `w2`).

use rayon::prelude::*;

use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::weights::{LayerWeights, Weights, check_host_memory, layer_tensor_sizes, try_vec};

/// Seed used by `dummy:NAME` without `@SEED`.
pub const DEFAULT_DUMMY_SEED: u64 = 0;

/// SplitMix64's output function (Steele, Lea, Flood 2014): add the golden-ratio increment, then
/// two xor-shift-multiply rounds. A bijection with good avalanche, cheap on CPU and GPU.
#[inline]
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform value in `[-1, 1)` with 24 random bits:
/// `h = splitmix64(seed ^ splitmix64((tensor << 48) ^ element))`, `u = (h >> 40) · 2⁻²⁴` (exact in
/// f32), result `u · 2 − 1` (exact). `element` must be below 2⁴⁸.
#[inline]
pub fn dummy_weight(seed: u64, tensor_index: u32, element: u64) -> f32 {
    debug_assert!(element < 1 << 48);
    let h = splitmix64(seed ^ splitmix64(((tensor_index as u64) << 48) ^ element));
    let u = (h >> 40) as f32 * (1.0 / (1u32 << 24) as f32);
    u * 2.0 - 1.0
}

/// Scale of a projection with rows of `fan_in` elements: `1/sqrt(fan_in)` computed in f64 and
/// rounded to f32 (a device kernel receives this value as a parameter).
pub fn dummy_scale(fan_in: usize) -> f32 {
    (1.0 / (fan_in as f64).sqrt()) as f32
}

/// Fills one tensor in parallel.
fn tensor(seed: u64, index: u32, len: usize, scale: Option<f32>) -> Result<Vec<f32>, ModelError> {
    let mut v = try_vec(len)?;
    match scale {
        None => v.par_extend((0..len).into_par_iter().map(|_| 1.0f32)),
        Some(s) => v.par_extend(
            (0..len)
                .into_par_iter()
                .map(|e| dummy_weight(seed, index, e as u64) * s),
        ),
    }
    Ok(v)
}

/// Generates the weights of `config` from `seed` (on the global rayon pool).
pub fn dummy_weights(config: &ModelConfig, seed: u64) -> Result<Weights, ModelError> {
    config.validate()?;
    check_host_memory(config.n_params() * 4)?;
    let (d, v, h) = (config.dim, config.vocab_size, config.hidden_dim);
    let sd = Some(dummy_scale(d));
    let token_embedding = tensor(seed, 0, v * d, sd)?;
    let sizes = layer_tensor_sizes(config);
    let mut layers = Vec::with_capacity(config.n_layers);
    for l in 0..config.n_layers {
        let base = 1 + 9 * l as u32;
        let t = |j: u32, scale: Option<f32>| tensor(seed, base + j, sizes[j as usize], scale);
        layers.push(LayerWeights {
            rms_att: t(0, None)?,
            wq: t(1, sd)?,
            wk: t(2, sd)?,
            wv: t(3, sd)?,
            wo: t(4, sd)?,
            rms_ffn: t(5, None)?,
            w1: t(6, sd)?,
            w2: t(7, Some(dummy_scale(h)))?,
            w3: t(8, sd)?,
        });
    }
    let last = 1 + 9 * config.n_layers as u32;
    let rms_final = tensor(seed, last, d, None)?;
    let classifier = if config.shared_classifier {
        None
    } else {
        Some(tensor(seed, last + 1, v * d, sd)?)
    };
    Weights::new(
        config.clone(),
        token_embedding,
        layers,
        rms_final,
        classifier,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dummy_weight_is_uniform_in_the_unit_interval() {
        let vals: Vec<f32> = (0..100_000).map(|e| dummy_weight(7, 3, e)).collect();
        assert!(vals.iter().all(|v| (-1.0..1.0).contains(v)));
        let mean = vals.iter().map(|&v| v as f64).sum::<f64>() / vals.len() as f64;
        assert!(mean.abs() < 0.01, "mean {mean}");
        let var = vals.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / vals.len() as f64;
        assert!((var - 1.0 / 3.0).abs() < 0.01, "variance {var}");
    }

    #[test]
    fn splitmix64_matches_the_published_reference_sequence() {
        // First outputs of the reference generator seeded with 1234567 (state += golden, mix).
        let mut state = 1_234_567u64;
        let mut next = || {
            let out = splitmix64(state);
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            out
        };
        assert_eq!(next(), 6_457_827_717_110_365_317);
        assert_eq!(next(), 3_203_168_211_198_807_973);
    }
}
