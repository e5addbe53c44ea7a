//! [`EngineConfig`] (every default a named constant) and [`SafetyConfig`].

use std::collections::HashMap;
use std::time::Duration;

use zerolayer_model::KvCacheConfig;

use crate::error::EngineError;

/// Default slot map capacity (design §5): 65,536 conversations. At ~600 bytes per entry the
/// map takes ~40 MB, and a conversation's KV blocks only exist while it holds tokens.
pub const DEFAULT_SLOT_CAPACITY: usize = 65_536;
/// Largest slot map capacity: the index table holds `u32` entry numbers and is twice the
/// capacity rounded up to a power of two.
pub const MAX_SLOT_CAPACITY: usize = 1 << 28;
/// Default KV block size in token positions: vLLM's default (16) — small enough that a
/// conversation wastes at most 15 positions, large enough that block tables stay short.
pub const DEFAULT_BLOCK_SIZE: usize = 16;
/// Default KV pool size in blocks: 1,024 × 16 = 16,384 token positions (about 21 MB for
/// stories260K, 1.2 GB for `dummy:small`). Size it for the deployment with `--kv-blocks`.
pub const DEFAULT_KV_BLOCKS: usize = 1_024;
/// Default most sequences per step: 64 (TGI's and vLLM's CPU defaults are in this range; on a
/// CPU, decode stops gaining from batching well before that).
pub const DEFAULT_MAX_BATCH: usize = 64;
/// Default token budget of one step (decode tokens + prefill chunks): 512 keeps a step's
/// activations small (≈ 512 × model width floats) and the inter-token latency of running
/// sequences bounded while a long prompt is prefilled in chunks.
pub const DEFAULT_STEP_TOKEN_BUDGET: usize = 512;
/// Default admission queue bound: 1,024 waiting requests; beyond, requests are shed with
/// `OVERLOADED` instead of queueing for minutes.
pub const DEFAULT_MAX_QUEUE: usize = 1_024;
/// Default handle lifetime: 24 hours (design §3).
pub const DEFAULT_HANDLE_TTL: Duration = Duration::from_secs(zerolayer_handle::DEFAULT_TTL_SECS);
/// Default wait for a conversation's running request before `SESSION_BUSY`: 2 s, about one
/// short turn; design §4 asks for a bounded wait.
pub const DEFAULT_SESSION_BUSY_WAIT: Duration = Duration::from_secs(2);
/// Largest number of forbidden strings per tenant (each is matched at every step).
pub const MAX_FORBIDDEN_STRINGS: usize = 1_024;
/// Longest forbidden string, in bytes (its text is held back while it could still match).
pub const MAX_FORBIDDEN_BYTES: usize = 256;

/// Engine settings. Build with [`EngineConfig::default`] and override fields.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Conversations the slot map holds ([`DEFAULT_SLOT_CAPACITY`]).
    pub slot_capacity: usize,
    /// Blocks in the KV pool ([`DEFAULT_KV_BLOCKS`]); must equal the backend's.
    pub kv_blocks: usize,
    /// Token positions per KV block ([`DEFAULT_BLOCK_SIZE`]); must equal the backend's.
    pub block_size: usize,
    /// Most sequences in one step ([`DEFAULT_MAX_BATCH`]).
    pub max_batch: usize,
    /// Most tokens in one step, decode and prefill together ([`DEFAULT_STEP_TOKEN_BUDGET`]);
    /// at least `max_batch` so a prefill always progresses.
    pub step_token_budget: usize,
    /// Most requests waiting for admission ([`DEFAULT_MAX_QUEUE`]); more are `OVERLOADED`.
    pub max_queue: usize,
    /// KV reuse across turns. `false` is the layered baseline: no handles are issued or
    /// honoured, every request prefills its whole prompt into a throwaway sequence, and the
    /// reuse outcome is [`crate::api::ReuseOutcome::Disabled`].
    pub reuse: bool,
    /// Lifetime of issued handles ([`DEFAULT_HANDLE_TTL`]).
    pub handle_ttl: Duration,
    /// Bounded wait for a conversation's running request ([`DEFAULT_SESSION_BUSY_WAIT`]).
    pub session_busy_wait: Duration,
    /// `max_tokens` of requests that do not say ([`crate::DEFAULT_MAX_TOKENS`]); clamped to
    /// the room left in the context window.
    pub default_max_tokens: u32,
    /// Worker threads of a CPU backend built by [`crate::Engine::start_cpu`].
    pub threads: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            slot_capacity: DEFAULT_SLOT_CAPACITY,
            kv_blocks: DEFAULT_KV_BLOCKS,
            block_size: DEFAULT_BLOCK_SIZE,
            max_batch: DEFAULT_MAX_BATCH,
            step_token_budget: DEFAULT_STEP_TOKEN_BUDGET,
            max_queue: DEFAULT_MAX_QUEUE,
            reuse: true,
            handle_ttl: DEFAULT_HANDLE_TTL,
            session_busy_wait: DEFAULT_SESSION_BUSY_WAIT,
            default_max_tokens: crate::DEFAULT_MAX_TOKENS,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    }
}

impl EngineConfig {
    /// The KV geometry a backend for this engine must be built with.
    pub fn kv_cache_config(&self) -> KvCacheConfig {
        KvCacheConfig {
            block_size: self.block_size,
            num_blocks: self.kv_blocks,
        }
    }

    /// Checks the settings against each other and against the backend's pool.
    pub fn validate(&self, backend_kv: KvCacheConfig) -> Result<(), EngineError> {
        let bad = |r: String| Err(EngineError::config(r));
        if backend_kv != self.kv_cache_config() {
            return bad(format!(
                "the backend's KV pool ({} blocks of {}) differs from the configuration ({} blocks of {})",
                backend_kv.num_blocks, backend_kv.block_size, self.kv_blocks, self.block_size
            ));
        }
        if self.block_size == 0 || self.kv_blocks == 0 || self.kv_blocks >= u32::MAX as usize {
            return bad(format!(
                "kv_blocks {} and block_size {} must be positive",
                self.kv_blocks, self.block_size
            ));
        }
        if self.max_batch == 0 {
            return bad("max_batch must be at least 1".into());
        }
        if !(2..=MAX_SLOT_CAPACITY).contains(&self.slot_capacity)
            || self.slot_capacity <= self.max_batch
        {
            return bad(format!(
                "slot_capacity {} must be within 2..={MAX_SLOT_CAPACITY} and above max_batch {}",
                self.slot_capacity, self.max_batch
            ));
        }
        if self.step_token_budget < self.max_batch {
            return bad(format!(
                "step_token_budget {} must be at least max_batch {} (decode tokens alone may fill a step)",
                self.step_token_budget, self.max_batch
            ));
        }
        if self.max_queue == 0 {
            return bad("max_queue must be at least 1".into());
        }
        if self.default_max_tokens == 0 {
            return bad("default_max_tokens must be at least 1".into());
        }
        if self.handle_ttl.as_secs() == 0 {
            return bad("handle_ttl must be at least one second".into());
        }
        Ok(())
    }
}

/// Per-tenant forbidden strings (design §4's in-decode safety mask). A tenant absent from the
/// map has no restriction.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SafetyConfig {
    /// Tenant name → strings its responses may never contain (and its prompts may not).
    pub per_tenant: HashMap<String, Vec<String>>,
}

impl SafetyConfig {
    /// No restrictions.
    pub fn none() -> Self {
        Self::default()
    }

    /// Adds `strings` to `tenant`'s list (builder style).
    #[must_use]
    pub fn forbid(mut self, tenant: &str, strings: &[&str]) -> Self {
        self.per_tenant
            .entry(tenant.to_string())
            .or_default()
            .extend(strings.iter().map(|s| s.to_string()));
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_config_is_valid_for_a_matching_backend() {
        let c = EngineConfig::default();
        c.validate(c.kv_cache_config())
            .expect("defaults are consistent");
    }

    #[test]
    fn mismatched_backend_pool_and_inconsistent_limits_are_rejected() {
        let c = EngineConfig::default();
        let other = KvCacheConfig {
            block_size: 8,
            num_blocks: c.kv_blocks,
        };
        assert!(c.validate(other).is_err());
        let small_budget = EngineConfig {
            step_token_budget: 4,
            max_batch: 8,
            ..EngineConfig::default()
        };
        assert!(
            small_budget
                .validate(small_budget.kv_cache_config())
                .is_err()
        );
        let tiny_map = EngineConfig {
            slot_capacity: 8,
            max_batch: 8,
            ..EngineConfig::default()
        };
        assert!(tiny_map.validate(tiny_map.kv_cache_config()).is_err());
    }
}
