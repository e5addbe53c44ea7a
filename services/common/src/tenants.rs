//! Tenants and API keys: who may call, under which limits, with which forbidden strings.
//!
//! Configuration comes from a TOML file (`--tenants-file`, see docs/operations.md) or from
//! the environment (`ZEROLAYER_API_KEYS="tenant=key,tenant=key"`, default limits). A dev
//! mode serves a single tenant `dev` without keys and warns at start.
//!
//! ```toml
//! [[tenants]]
//! name = "acme"
//! api_keys = ["zl-acme-0123456789abcdef"]
//! rate_limit_tokens_per_s = 2000.0   # 0 = unlimited
//! burst_tokens = 8000
//! max_concurrency = 16               # 0 = unlimited
//! forbidden = ["launch code"]        # never delivered to this tenant (engine safety mask)
//! ```

use std::{collections::HashMap, path::Path, sync::Arc};

use serde::Deserialize;
use zerolayer_engine::api::ErrorReason;

use crate::error::ApiError;

/// Tenant name used by dev mode.
pub const DEV_TENANT: &str = "dev";
/// Default token rate of tenants configured from the environment: 0 = unlimited.
pub const DEFAULT_RATE_TOKENS_PER_S: f64 = 0.0;
/// Default concurrency of tenants configured from the environment: 0 = unlimited.
pub const DEFAULT_MAX_CONCURRENCY: u32 = 0;
/// Shortest API key accepted in configuration: 16 bytes keeps brute force out of reach.
pub const MIN_API_KEY_BYTES: usize = 16;

/// Limits and policy of one tenant.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantPolicy {
    /// Tenant name; context handles are bound to it.
    pub name: String,
    /// API keys that authenticate as this tenant (stored hashed in memory).
    #[serde(default)]
    pub api_keys: Vec<String>,
    /// Sustained token rate (prefilled + generated tokens per second); 0 = unlimited.
    #[serde(default)]
    pub rate_limit_tokens_per_s: f64,
    /// Token bucket size; 0 = 4 seconds' worth of the rate.
    #[serde(default)]
    pub burst_tokens: u64,
    /// Concurrent requests at most; 0 = unlimited.
    #[serde(default)]
    pub max_concurrency: u32,
    /// Strings this tenant may never receive (the engine masks them during decoding).
    #[serde(default)]
    pub forbidden: Vec<String>,
}

impl TenantPolicy {
    /// A tenant with no limits.
    pub fn unlimited(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            api_keys: Vec::new(),
            rate_limit_tokens_per_s: DEFAULT_RATE_TOKENS_PER_S,
            burst_tokens: 0,
            max_concurrency: DEFAULT_MAX_CONCURRENCY,
            forbidden: Vec::new(),
        }
    }

    /// Effective bucket size in tokens.
    pub fn burst(&self) -> f64 {
        if self.burst_tokens > 0 {
            self.burst_tokens as f64
        } else {
            self.rate_limit_tokens_per_s * 4.0
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantsFile {
    tenants: Vec<TenantPolicy>,
}

/// Errors of tenant configuration (start-up only).
#[derive(Debug, thiserror::Error)]
pub enum TenantsError {
    /// The file could not be read.
    #[error("cannot read tenants file {path}: {source}")]
    Read {
        /// File path.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
    /// The file is not valid TOML of the expected shape.
    #[error("tenants file {path}: {source}")]
    Parse {
        /// File path.
        path: String,
        /// Cause.
        source: toml::de::Error,
    },
    /// A semantic problem (duplicate key, short key, bad number).
    #[error("tenants configuration: {0}")]
    Invalid(String),
}

/// All tenants, with an index from hashed API key to tenant.
#[derive(Debug, Clone)]
pub struct Tenants {
    by_key: HashMap<[u8; 32], Arc<TenantPolicy>>,
    by_name: HashMap<String, Arc<TenantPolicy>>,
    dev: Option<Arc<TenantPolicy>>,
}

impl Tenants {
    /// Dev mode: every call is tenant `dev`, with or without a key. Logs a warning.
    pub fn dev_mode() -> Self {
        tracing::warn!(
            tenant = DEV_TENANT,
            "authentication disabled (dev mode): every caller is tenant `dev`; do not expose this"
        );
        let dev = Arc::new(TenantPolicy::unlimited(DEV_TENANT));
        let by_name = HashMap::from([(DEV_TENANT.to_owned(), dev.clone())]);
        Self {
            by_key: HashMap::new(),
            by_name,
            dev: Some(dev),
        }
    }

    /// Builds the index from policies; rejects duplicate names or keys and short keys.
    pub fn from_policies(policies: Vec<TenantPolicy>) -> Result<Self, TenantsError> {
        let mut by_key = HashMap::new();
        let mut by_name = HashMap::new();
        for policy in policies {
            if policy.name.is_empty() || !policy.name.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(TenantsError::Invalid(format!(
                    "tenant name {:?} must be printable ASCII",
                    policy.name
                )));
            }
            if !(policy.rate_limit_tokens_per_s.is_finite()
                && policy.rate_limit_tokens_per_s >= 0.0)
            {
                return Err(TenantsError::Invalid(format!(
                    "tenant {}: rate_limit_tokens_per_s must be a finite number >= 0",
                    policy.name
                )));
            }
            let policy = Arc::new(policy);
            for key in &policy.api_keys {
                if key.len() < MIN_API_KEY_BYTES {
                    return Err(TenantsError::Invalid(format!(
                        "tenant {}: API keys must be at least {MIN_API_KEY_BYTES} bytes",
                        policy.name
                    )));
                }
                if by_key.insert(hash_key(key), policy.clone()).is_some() {
                    return Err(TenantsError::Invalid(format!(
                        "tenant {}: an API key is configured twice",
                        policy.name
                    )));
                }
            }
            if by_name
                .insert(policy.name.clone(), policy.clone())
                .is_some()
            {
                return Err(TenantsError::Invalid(format!(
                    "tenant {} defined twice",
                    policy.name
                )));
            }
        }
        Ok(Self {
            by_key,
            by_name,
            dev: None,
        })
    }

    /// Loads a TOML tenants file.
    pub fn from_file(path: &Path) -> Result<Self, TenantsError> {
        let display = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| TenantsError::Read {
            path: display.clone(),
            source,
        })?;
        Self::from_toml(&text).map_err(|e| match e {
            TenantsError::Parse { source, .. } => TenantsError::Parse {
                path: display,
                source,
            },
            other => other,
        })
    }

    /// Parses TOML tenants configuration.
    pub fn from_toml(text: &str) -> Result<Self, TenantsError> {
        let file: TenantsFile = toml::from_str(text).map_err(|source| TenantsError::Parse {
            path: "<inline>".into(),
            source,
        })?;
        Self::from_policies(file.tenants)
    }

    /// Parses `tenant=key,tenant=key` (the `ZEROLAYER_API_KEYS` format); default limits.
    pub fn from_env_spec(spec: &str) -> Result<Self, TenantsError> {
        let mut policies: Vec<TenantPolicy> = Vec::new();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (name, key) = item.split_once('=').ok_or_else(|| {
                TenantsError::Invalid("ZEROLAYER_API_KEYS entries are tenant=key".into())
            })?;
            match policies.iter_mut().find(|p| p.name == name) {
                Some(p) => p.api_keys.push(key.to_owned()),
                None => {
                    let mut p = TenantPolicy::unlimited(name);
                    p.api_keys.push(key.to_owned());
                    policies.push(p);
                }
            }
        }
        if policies.is_empty() {
            return Err(TenantsError::Invalid("ZEROLAYER_API_KEYS is empty".into()));
        }
        Self::from_policies(policies)
    }

    /// The tenant of a request's metadata (`authorization: Bearer <key>`).
    pub fn authenticate(
        &self,
        metadata: &tonic::metadata::MetadataMap,
    ) -> Result<Arc<TenantPolicy>, ApiError> {
        if let Some(dev) = &self.dev {
            return Ok(dev.clone());
        }
        let header = metadata.get("authorization").ok_or_else(|| {
            ApiError::new(
                ErrorReason::Unauthenticated,
                "missing `authorization: Bearer <key>`",
            )
        })?;
        let key = header
            .to_str()
            .ok()
            .and_then(|v| {
                v.strip_prefix("Bearer ")
                    .or_else(|| v.strip_prefix("bearer "))
            })
            .ok_or_else(|| {
                ApiError::new(
                    ErrorReason::Unauthenticated,
                    "authorization must be `Bearer <key>`",
                )
            })?;
        self.by_key
            .get(&hash_key(key.trim()))
            .cloned()
            .ok_or_else(|| ApiError::new(ErrorReason::Unauthenticated, "unknown API key"))
    }

    /// A tenant by name (the engine side of split mode receives names from the front).
    pub fn by_name(&self, name: &str) -> Option<Arc<TenantPolicy>> {
        self.by_name.get(name).cloned()
    }

    /// Every tenant (for the engine's safety configuration).
    pub fn policies(&self) -> impl Iterator<Item = &Arc<TenantPolicy>> {
        self.by_name.values()
    }

    /// Forbidden strings per tenant name.
    pub fn forbidden_by_tenant(&self) -> HashMap<String, Vec<String>> {
        self.by_name
            .values()
            .filter(|p| !p.forbidden.is_empty())
            .map(|p| (p.name.clone(), p.forbidden.clone()))
            .collect()
    }

    /// True in dev mode.
    pub fn is_dev_mode(&self) -> bool {
        self.dev.is_some()
    }
}

/// Keys are looked up by hash so the lookup's timing says nothing about key bytes.
fn hash_key(key: &str) -> [u8; 32] {
    blake3::derive_key("zerolayer 2026-11 api key index v1", key.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::metadata::{MetadataMap, MetadataValue};

    fn bearer(key: &str) -> MetadataMap {
        let mut m = MetadataMap::new();
        m.insert(
            "authorization",
            MetadataValue::try_from(format!("Bearer {key}")).expect("ascii"),
        );
        m
    }

    const TOML: &str = r#"
        [[tenants]]
        name = "acme"
        api_keys = ["acme-key-0123456789"]
        rate_limit_tokens_per_s = 100.0
        max_concurrency = 2
        forbidden = ["secret"]

        [[tenants]]
        name = "beta"
        api_keys = ["beta-key-0123456789"]
    "#;

    #[test]
    fn api_keys_map_to_their_tenants() {
        let t = Tenants::from_toml(TOML).expect("valid");
        assert_eq!(
            t.authenticate(&bearer("acme-key-0123456789"))
                .expect("acme")
                .name,
            "acme"
        );
        assert_eq!(
            t.authenticate(&bearer("beta-key-0123456789"))
                .expect("beta")
                .name,
            "beta"
        );
        assert_eq!(t.forbidden_by_tenant()["acme"], vec!["secret".to_owned()]);
    }

    #[test]
    fn missing_malformed_and_unknown_keys_are_unauthenticated() {
        let t = Tenants::from_toml(TOML).expect("valid");
        for metadata in [MetadataMap::new(), bearer("nope-nope-nope-nope"), {
            let mut m = MetadataMap::new();
            m.insert("authorization", MetadataValue::from_static("Basic abc"));
            m
        }] {
            let err = t.authenticate(&metadata).expect_err("rejected");
            assert_eq!(err.reason, ErrorReason::Unauthenticated);
        }
    }

    #[test]
    fn dev_mode_accepts_everyone_as_dev() {
        let t = Tenants::dev_mode();
        assert_eq!(
            t.authenticate(&MetadataMap::new()).expect("dev").name,
            DEV_TENANT
        );
    }

    #[test]
    fn bad_configurations_are_rejected_at_start() {
        assert!(Tenants::from_toml("[[tenants]]\nname = \"a\"\napi_keys = [\"short\"]").is_err());
        assert!(Tenants::from_toml("[[tenants]]\nname = \"a\"\nunknown = 1").is_err());
        let dup = "[[tenants]]\nname=\"a\"\napi_keys=[\"0123456789abcdef\"]\n[[tenants]]\nname=\"b\"\napi_keys=[\"0123456789abcdef\"]";
        assert!(Tenants::from_toml(dup).is_err());
        assert!(Tenants::from_env_spec("").is_err());
        assert!(Tenants::from_env_spec("novalue").is_err());
    }

    #[test]
    fn env_spec_groups_keys_by_tenant() {
        let t = Tenants::from_env_spec("a=0123456789abcdef, a=fedcba9876543210,b=0123456789abcdeX")
            .expect("valid");
        assert_eq!(
            t.authenticate(&bearer("fedcba9876543210")).expect("a").name,
            "a"
        );
        assert_eq!(t.by_name("a").expect("a").api_keys.len(), 2);
    }
}
