//! `zerolayer serve --mode collapsed|engine|front|orchestrator`: runs one serving process.
//!
//! Every flag is also read from its `ZEROLAYER_*` environment variable (compose files
//! configure by environment). Processes print `zerolayer listening …` once bound and
//! `zerolayer ready …` once they serve (see `zerolayer_service::server`).

use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use anyhow::Context as _;
use zerolayer_engine::{
    EngineConfig,
    config::{
        DEFAULT_BLOCK_SIZE, DEFAULT_KV_BLOCKS, DEFAULT_MAX_BATCH, DEFAULT_MAX_QUEUE,
        DEFAULT_SESSION_BUSY_WAIT, DEFAULT_SLOT_CAPACITY, DEFAULT_STEP_TOKEN_BUDGET,
    },
};
use zerolayer_engine_service::{
    EngineProcessConfig,
    runtime::{Device, EngineSetup},
};
use zerolayer_handle::KeyRing;
use zerolayer_service::{
    limits::DEFAULT_MAX_IN_FLIGHT,
    server::{DEFAULT_DRAIN_TIMEOUT, ServeConfig, termination_signal},
    tenants::Tenants,
};
use zerolayer_shm::ShmConfig;

/// Which process to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// The engine serves gRPC itself (no front, no shared-memory hop).
    Collapsed,
    /// Split mode, engine half: serves a front over shared memory.
    Engine,
    /// Split mode, front half: gRPC in, shared memory to the engine.
    Front,
    /// Layered baseline: Redis transcripts + full prompt over gRPC to an engine.
    Orchestrator,
}

/// Listen addresses and lifecycle.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// gRPC listen address (port 0 picks a free port; the `listening` line tells which).
    #[arg(long, env = "ZEROLAYER_GRPC_ADDR", default_value = "127.0.0.1:50051")]
    pub grpc_addr: SocketAddr,
    /// Prometheus `/metrics` listen address, or `none`.
    #[arg(long, env = "ZEROLAYER_METRICS_ADDR", default_value = "127.0.0.1:9090")]
    pub metrics_addr: String,
    /// Seconds in-flight streams get to finish after SIGTERM.
    #[arg(long, env = "ZEROLAYER_DRAIN_TIMEOUT_S", default_value_t = DEFAULT_DRAIN_TIMEOUT.as_secs())]
    pub drain_timeout_s: u64,
    /// Requests in flight before the process sheds load with OVERLOADED.
    #[arg(long, env = "ZEROLAYER_MAX_IN_FLIGHT", default_value_t = DEFAULT_MAX_IN_FLIGHT)]
    pub max_in_flight: usize,
}

impl ServeArgs {
    /// The serve configuration of service `name`.
    pub fn config(&self, name: &'static str) -> anyhow::Result<ServeConfig> {
        let metrics_addr = match self.metrics_addr.as_str() {
            "" | "none" => None,
            a => Some(a.parse().with_context(|| format!("--metrics-addr {a:?}"))?),
        };
        Ok(ServeConfig {
            service: name,
            grpc_addr: self.grpc_addr,
            metrics_addr,
            drain_timeout: Duration::from_secs(self.drain_timeout_s),
        })
    }
}

/// Who may call.
#[derive(Debug, Clone, clap::Args)]
pub struct AuthArgs {
    /// Tenants file (TOML: names, API keys, limits, forbidden strings; docs/operations.md).
    #[arg(long, env = "ZEROLAYER_TENANTS_FILE")]
    pub tenants_file: Option<PathBuf>,
    /// API keys as `tenant=key,tenant=key` (unlimited tenants).
    #[arg(long, env = "ZEROLAYER_API_KEYS", hide_env_values = true)]
    pub api_keys: Option<String>,
    /// Accept every call as tenant `dev` without a key (development only; warns at start).
    #[arg(long, env = "ZEROLAYER_DEV_AUTH")]
    pub dev_auth: bool,
}

impl AuthArgs {
    /// Loads the tenants.
    pub fn tenants(&self) -> anyhow::Result<Arc<Tenants>> {
        let tenants = match (&self.tenants_file, &self.api_keys, self.dev_auth) {
            (Some(path), _, _) => Tenants::from_file(path)?,
            (None, Some(spec), _) => Tenants::from_env_spec(spec)?,
            (None, None, true) => Tenants::dev_mode(),
            (None, None, false) => anyhow::bail!(
                "no authentication configured: pass --tenants-file, --api-keys (ZEROLAYER_API_KEYS) or --dev-auth"
            ),
        };
        Ok(Arc::new(tenants))
    }
}

/// Context-handle signing keys.
#[derive(Debug, Clone, clap::Args)]
pub struct KeyArgs {
    /// Directory written by `zerolayer keygen` (signing.key + verifying.keys). Without it an
    /// ephemeral key is generated: handles then die with the process.
    #[arg(long, env = "ZEROLAYER_KEY_DIR")]
    pub key_dir: Option<PathBuf>,
    /// Handle lifetime in seconds.
    #[arg(long, env = "ZEROLAYER_HANDLE_TTL_S", default_value_t = zerolayer_handle::DEFAULT_TTL_SECS)]
    pub handle_ttl_s: u64,
}

impl KeyArgs {
    /// Loads (or generates) the key ring.
    pub fn keys(&self) -> anyhow::Result<Arc<KeyRing>> {
        match &self.key_dir {
            Some(dir) => {
                let signing = dir.join("signing.key");
                let verifying = dir.join("verifying.keys");
                let verifying: Vec<PathBuf> = if verifying.exists() {
                    vec![verifying]
                } else {
                    Vec::new()
                };
                Ok(Arc::new(
                    KeyRing::from_files(&signing, &verifying)
                        .with_context(|| format!("loading handle keys from {}", dir.display()))?,
                ))
            }
            None => {
                tracing::warn!(
                    "no --key-dir: using an ephemeral signing key (handles do not survive a restart)"
                );
                Ok(Arc::new(KeyRing::ephemeral()?))
            }
        }
    }
}

/// Engine settings.
#[derive(Debug, Clone, clap::Args)]
pub struct EngineArgs {
    /// Model: `dummy:NAME[@SEED]` (tiny, small, 1b, 8b) or a llama2.c checkpoint path.
    #[arg(long, env = "ZEROLAYER_MODEL", default_value = "dummy:tiny")]
    pub model: String,
    /// Tokenizer file for checkpoints (default: beside the checkpoint).
    #[arg(long, env = "ZEROLAYER_TOKENIZER")]
    pub tokenizer: Option<PathBuf>,
    /// Backend device: `cpu` or `cuda:N`.
    #[arg(long, env = "ZEROLAYER_DEVICE", default_value = "cpu")]
    pub device: Device,
    /// Compute threads (0 = all cores).
    #[arg(long, env = "ZEROLAYER_THREADS", default_value_t = 0)]
    pub threads: usize,
    /// KV pool size in MiB (overrides --kv-blocks).
    #[arg(long, env = "ZEROLAYER_KV_CACHE_MB")]
    pub kv_cache_mb: Option<usize>,
    /// KV pool size in blocks.
    #[arg(long, env = "ZEROLAYER_KV_BLOCKS", default_value_t = DEFAULT_KV_BLOCKS)]
    pub kv_blocks: usize,
    /// Token positions per KV block.
    #[arg(long, env = "ZEROLAYER_BLOCK_SIZE", default_value_t = DEFAULT_BLOCK_SIZE)]
    pub block_size: usize,
    /// Slot map capacity (conversations kept).
    #[arg(long, env = "ZEROLAYER_SLOTS", default_value_t = DEFAULT_SLOT_CAPACITY)]
    pub slots: usize,
    /// Sequences per forward step at most.
    #[arg(long, env = "ZEROLAYER_MAX_BATCH", default_value_t = DEFAULT_MAX_BATCH)]
    pub max_batch: usize,
    /// Tokens per forward step at most (chunked prefill budget).
    #[arg(long, env = "ZEROLAYER_STEP_TOKENS", default_value_t = DEFAULT_STEP_TOKEN_BUDGET)]
    pub step_tokens: usize,
    /// Requests waiting for admission before OVERLOADED.
    #[arg(long, env = "ZEROLAYER_MAX_QUEUE", default_value_t = DEFAULT_MAX_QUEUE)]
    pub max_queue: usize,
    /// Disable KV reuse and handles (the layered baseline's engine).
    #[arg(long, env = "ZEROLAYER_NO_REUSE")]
    pub no_reuse: bool,
    /// Milliseconds a request waits for its conversation's running turn before SESSION_BUSY.
    #[arg(long, env = "ZEROLAYER_SESSION_BUSY_WAIT_MS", default_value_t = DEFAULT_SESSION_BUSY_WAIT.as_millis() as u64)]
    pub session_busy_wait_ms: u64,
}

impl EngineArgs {
    /// Engine settings from the flags.
    pub fn engine_config(&self, handle_ttl: Duration) -> EngineConfig {
        let threads = if self.threads == 0 {
            std::thread::available_parallelism().map_or(1, usize::from)
        } else {
            self.threads
        };
        EngineConfig {
            slot_capacity: self.slots,
            kv_blocks: self.kv_blocks,
            block_size: self.block_size,
            max_batch: self.max_batch,
            step_token_budget: self.step_tokens,
            max_queue: self.max_queue,
            reuse: !self.no_reuse,
            handle_ttl,
            session_busy_wait: Duration::from_millis(self.session_busy_wait_ms),
            threads,
            ..EngineConfig::default()
        }
    }
}

/// Shared-memory channel settings (split mode).
#[derive(Debug, Clone, clap::Args)]
pub struct ShmArgs {
    /// Segment name under /dev/shm, or an absolute path on a tmpfs shared by both processes.
    #[arg(long, env = "ZEROLAYER_SHM", default_value = "zerolayer")]
    pub shm: String,
    /// Request ring size in MiB.
    #[arg(long, env = "ZEROLAYER_SHM_REQUEST_RING_MB", default_value_t = 8)]
    pub shm_request_ring_mb: usize,
    /// Response ring size in MiB.
    #[arg(long, env = "ZEROLAYER_SHM_RESPONSE_RING_MB", default_value_t = 4)]
    pub shm_response_ring_mb: usize,
    /// How long a waiting side of the channel busy-polls before it sleeps on a futex, in
    /// microseconds (0: sleep at once). Longer spins save wake-ups on machines with idle cores
    /// and cost CPU on busy ones.
    #[arg(long, env = "ZEROLAYER_SHM_SPIN_US", default_value_t = zerolayer_shm::config::DEFAULT_SPIN.as_micros() as u64)]
    pub shm_spin_us: u64,
}

impl ShmArgs {
    /// The channel configuration.
    pub fn config(&self) -> anyhow::Result<ShmConfig> {
        let mut cfg =
            ShmConfig::new(&self.shm).map_err(|e| anyhow::anyhow!("--shm {:?}: {e}", self.shm))?;
        cfg.request_ring_bytes = self.shm_request_ring_mb << 20;
        cfg.response_ring_bytes = self.shm_response_ring_mb << 20;
        cfg.wait = zerolayer_shm::WaitStrategy::SpinThenPark {
            spin: Duration::from_micros(self.shm_spin_us),
        };
        cfg.validate()
            .map_err(|e| anyhow::anyhow!("shared-memory settings: {e}"))?;
        Ok(cfg)
    }
}

/// Layered baseline settings.
#[derive(Debug, Clone, clap::Args)]
pub struct OrchestratorArgs {
    /// Redis URL.
    #[arg(
        long,
        env = "ZEROLAYER_REDIS_URL",
        default_value = "redis://127.0.0.1:6379"
    )]
    pub redis_url: String,
    /// Multiplexed Redis connections.
    #[arg(long, env = "ZEROLAYER_REDIS_CONNECTIONS", default_value_t = zerolayer_orchestrator::DEFAULT_REDIS_CONNECTIONS)]
    pub redis_connections: usize,
    /// The engine's gRPC URL (an engine started with --no-reuse).
    #[arg(
        long,
        env = "ZEROLAYER_ENGINE_URL",
        default_value = "http://127.0.0.1:50052"
    )]
    pub engine_url: String,
    /// API key for the engine.
    #[arg(long, env = "ZEROLAYER_ENGINE_API_KEY", hide_env_values = true)]
    pub engine_api_key: Option<String>,
}

/// Arguments of `zerolayer serve`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Which process to run.
    #[arg(long, env = "ZEROLAYER_MODE", value_enum)]
    pub mode: Mode,
    #[command(flatten)]
    pub serve: ServeArgs,
    #[command(flatten)]
    pub auth: AuthArgs,
    #[command(flatten)]
    pub keys: KeyArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub shm: ShmArgs,
    #[command(flatten)]
    pub orchestrator: OrchestratorArgs,
}

/// Runs `zerolayer serve`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(serve(args))
}

async fn serve(args: Args) -> anyhow::Result<()> {
    let tenants = args.auth.tenants()?;
    let ttl = Duration::from_secs(args.keys.handle_ttl_s);
    let engine_config = |keys| -> anyhow::Result<EngineProcessConfig> {
        Ok(EngineProcessConfig {
            setup: EngineSetup {
                model: args.engine.model.clone(),
                tokenizer: args.engine.tokenizer.clone(),
                device: args.engine.device,
                kv_cache_mb: args.engine.kv_cache_mb,
                engine: args.engine.engine_config(ttl),
                keys,
                tenants: tenants.clone(),
            },
            serve: args.serve.config(match args.mode {
                Mode::Collapsed => "collapsed",
                _ => "engine",
            })?,
            max_in_flight: args.serve.max_in_flight,
        })
    };
    match args.mode {
        Mode::Collapsed => {
            let config = engine_config(args.keys.keys()?)?;
            zerolayer_engine_service::run_collapsed(config, termination_signal()).await
        }
        Mode::Engine => {
            let config = engine_config(args.keys.keys()?)?;
            zerolayer_engine_service::run_engine(config, args.shm.config()?, termination_signal())
                .await
        }
        Mode::Front => {
            let config = zerolayer_front::FrontConfig {
                serve: args.serve.config("front")?,
                shm: args.shm.config()?,
                tenants,
                max_in_flight: args.serve.max_in_flight,
            };
            zerolayer_front::run(config, termination_signal()).await
        }
        Mode::Orchestrator => {
            let config = zerolayer_orchestrator::OrchestratorConfig {
                serve: args.serve.config("orchestrator")?,
                redis_url: args.orchestrator.redis_url.clone(),
                redis_connections: args.orchestrator.redis_connections,
                engine_url: args.orchestrator.engine_url.clone(),
                engine_api_key: args.orchestrator.engine_api_key.clone(),
                keys: args.keys.keys()?,
                tenants,
                ttl,
                max_in_flight: args.serve.max_in_flight,
            };
            zerolayer_orchestrator::run(config, termination_signal()).await
        }
    }
}
