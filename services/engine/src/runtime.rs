//! Start-up of an engine process: model, backend, KV pool sizing, the engine itself, and the
//! Prometheus rendering of its counters.

use std::{
    path::PathBuf,
    sync::{Arc, atomic::AtomicU64},
};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeLabelSet},
    metrics::MetricType,
    registry::Registry,
};
use zerolayer_engine::{
    Engine, EngineConfig, EngineMetrics, SafetyConfig,
    api::ErrorReason,
    metrics::{
        BATCH_SIZE_BUCKETS, FINISH_REASONS, REUSE_OUTCOMES, TTFT_BUCKETS_NS, finish_reason_label,
        reuse_label,
    },
};
use zerolayer_handle::{HandleError, KeyRing};
use zerolayer_model::{
    Backend, CpuBackend, CudaDType, ModelConfig, Tokenizer,
    cuda::{CUDA_DTYPE_ENV, KvSize, load_cuda_model},
    load_model,
};
use zerolayer_service::tenants::Tenants;

/// Where the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// The CPU backend (f32; the oracle).
    Cpu,
    /// An NVIDIA GPU by ordinal (`cuda:0`).
    Cuda(usize),
}

impl std::str::FromStr for Device {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Self::Cuda)
                .ok_or_else(|| format!("unknown device {s:?}: use cpu or cuda:N")),
        }
    }
}

/// Everything needed to start an engine.
#[derive(Debug, Clone)]
pub struct EngineSetup {
    /// Model spec: `dummy:NAME[@SEED]` or a llama2.c checkpoint path.
    pub model: String,
    /// Tokenizer file (checkpoints only; default: beside the checkpoint).
    pub tokenizer: Option<PathBuf>,
    /// Backend device.
    pub device: Device,
    /// KV pool size in MiB; `None` keeps `engine.kv_blocks`.
    pub kv_cache_mb: Option<usize>,
    /// Engine settings.
    pub engine: EngineConfig,
    /// Handle keys.
    pub keys: Arc<KeyRing>,
    /// Tenants (their forbidden strings configure the safety mask).
    pub tenants: Arc<Tenants>,
}

/// Bytes of one KV block of `config` at 4 bytes per element (K and V, every layer).
pub fn kv_block_bytes(config: &ModelConfig, block_size: usize) -> usize {
    2 * config.n_layers * block_size * config.kv_dim() * 4
}

/// Loads the model, builds the backend and starts the engine. Returns the engine and the
/// model's display name.
pub fn start_engine(setup: &EngineSetup) -> anyhow::Result<(Engine, String)> {
    let mut config = setup.engine.clone();
    let name = display_name(&setup.model);
    let (backend, tokenizer): (Box<dyn Backend>, Arc<Tokenizer>) = match setup.device {
        Device::Cpu => {
            let model = load_model(&setup.model, setup.tokenizer.as_deref())
                .map_err(|e| anyhow::anyhow!("cannot load model {}: {e}", setup.model))?;
            if let Some(mb) = setup.kv_cache_mb {
                let per_block = kv_block_bytes(model.weights.config(), config.block_size).max(1);
                config.kv_blocks = ((mb << 20) / per_block).max(1);
            }
            let backend = CpuBackend::new(
                model.weights.clone(),
                config.kv_cache_config(),
                config.threads,
            )
            .map_err(|e| anyhow::anyhow!("CPU backend: {e}"))?;
            (Box::new(backend), model.tokenizer.clone())
        }
        // Dummy models are generated on the GPU (never in host memory). Storage is bf16
        // unless ZEROLAYER_CUDA_DTYPE=f32 (exact, for parity with the CPU).
        Device::Cuda(ordinal) => {
            let dtype: CudaDType = match std::env::var(CUDA_DTYPE_ENV) {
                Ok(v) => v
                    .parse()
                    .map_err(|e: String| anyhow::anyhow!("{CUDA_DTYPE_ENV}: {e}"))?,
                Err(_) => CudaDType::Bf16,
            };
            let kv = match setup.kv_cache_mb {
                Some(mb) => KvSize::Mib(mb),
                None => KvSize::Blocks(config.kv_blocks),
            };
            let model = load_cuda_model(
                &setup.model,
                setup.tokenizer.as_deref(),
                dtype,
                config.block_size,
                kv,
                ordinal,
            )
            .map_err(|e| anyhow::anyhow!("--device cuda:{ordinal}: {}: {e}", setup.model))?;
            config.kv_blocks = model.backend.kv_config().num_blocks;
            (Box::new(model.backend), model.tokenizer)
        }
    };
    let safety = SafetyConfig {
        per_tenant: setup.tenants.forbidden_by_tenant(),
    };
    tracing::info!(
        model = %name,
        device = ?setup.device,
        params = backend.config().n_params(),
        kv_blocks = config.kv_blocks,
        block_size = config.block_size,
        slots = config.slot_capacity,
        reuse = config.reuse,
        "starting engine"
    );
    let engine = Engine::start(
        backend,
        tokenizer,
        name.clone(),
        setup.keys.clone(),
        safety,
        config,
    )
    .map_err(|e| anyhow::anyhow!("cannot start the engine: {e}"))?;
    Ok((engine, name))
}

/// `stories260K` for `/path/stories260K.bin`, the spec itself for dummy models.
fn display_name(spec: &str) -> String {
    if spec.starts_with("dummy:") {
        return spec.to_owned();
    }
    std::path::Path::new(spec)
        .file_stem()
        .map_or_else(|| spec.to_owned(), |s| s.to_string_lossy().into_owned())
}

/// Renders [`EngineMetrics`] at scrape time.
#[derive(Debug)]
pub struct EngineCollector(pub Arc<EngineMetrics>);

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PathLabel {
    path: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

fn get(a: &AtomicU64) -> u64 {
    EngineMetrics::get(a)
}

fn counter(enc: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: u64) -> std::fmt::Result {
    enc.encode_descriptor(name, help, None, MetricType::Counter)?
        .encode_counter::<prometheus_client::encoding::NoLabelSet, _, u64>(&v, None)
}

fn gauge(enc: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: u64) -> std::fmt::Result {
    enc.encode_descriptor(name, help, None, MetricType::Gauge)?
        .encode_gauge(&(v as i64))
}

impl Collector for EngineCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> std::fmt::Result {
        let m = &self.0;
        {
            let mut family = enc.encode_descriptor(
                "engine_finished",
                "Requests that finished normally, by finish reason",
                None,
                MetricType::Counter,
            )?;
            for r in FINISH_REASONS {
                let labels = ReasonLabel {
                    reason: finish_reason_label(r),
                };
                family
                    .encode_family(&labels)?
                    .encode_counter::<prometheus_client::encoding::NoLabelSet, _, u64>(
                        &m.finished_count(r),
                        None,
                    )?;
            }
        }
        {
            let mut family = enc.encode_descriptor(
                "engine_errors",
                "Requests that failed inside the engine, by reason",
                None,
                MetricType::Counter,
            )?;
            for r in ErrorReason::ALL {
                let labels = ReasonLabel { reason: r.as_str() };
                family
                    .encode_family(&labels)?
                    .encode_counter::<prometheus_client::encoding::NoLabelSet, _, u64>(
                        &m.error_count(r),
                        None,
                    )?;
            }
        }
        {
            let mut family = enc.encode_descriptor(
                "slot_lookups",
                "Requests by cache outcome (hit, miss, new, disabled)",
                None,
                MetricType::Counter,
            )?;
            for r in REUSE_OUTCOMES {
                family
                    .encode_family(&OutcomeLabel {
                        outcome: reuse_label(r),
                    })?
                    .encode_counter::<prometheus_client::encoding::NoLabelSet, _, u64>(
                        &m.reuse_count(r),
                        None,
                    )?;
            }
        }
        {
            let mut family = enc.encode_descriptor(
                "handle_verify",
                "Context handles by verification path: fast_path, full_verify, or rejected",
                None,
                MetricType::Counter,
            )?;
            family
                .encode_family(&PathLabel { path: "fast_path" })?
                .encode_counter::<prometheus_client::encoding::NoLabelSet, _, u64>(
                &get(&m.handle_fast_path),
                None,
            )?;
            family
                .encode_family(&PathLabel {
                    path: "full_verify",
                })?
                .encode_counter::<prometheus_client::encoding::NoLabelSet, _, u64>(
                    &get(&m.handle_full_verify),
                    None,
                )?;
            let rejected: u64 = m.handle_rejected.iter().map(get).sum();
            family
                .encode_family(&PathLabel { path: "rejected" })?
                .encode_counter::<prometheus_client::encoding::NoLabelSet, _, u64>(&rejected, None)?;
        }
        {
            let mut family = enc.encode_descriptor(
                "handle_rejected",
                "Rejected context handles by reason",
                None,
                MetricType::Counter,
            )?;
            for (i, reason) in HandleError::REASONS.iter().enumerate() {
                let v = m.handle_rejected.get(i).map_or(0, get);
                family
                    .encode_family(&ReasonLabel { reason })?
                    .encode_counter::<prometheus_client::encoding::NoLabelSet, _, u64>(&v, None)?;
            }
        }
        counter(
            &mut enc,
            "slot_evictions",
            "Slots evicted to make room (LRU 5%)",
            get(&m.slot_evictions),
        )?;
        gauge(
            &mut enc,
            "slots_live",
            "Slots holding a conversation",
            get(&m.slots_live),
        )?;
        gauge(
            &mut enc,
            "slots_capacity",
            "Slot map capacity",
            get(&m.slots_capacity),
        )?;
        gauge(
            &mut enc,
            "kv_blocks_total",
            "KV pool blocks",
            get(&m.kv_blocks_total),
        )?;
        gauge(
            &mut enc,
            "kv_blocks_used",
            "KV pool blocks in use",
            get(&m.kv_blocks_used),
        )?;
        gauge(
            &mut enc,
            "kv_block_size_tokens",
            "Token positions per KV block",
            get(&m.kv_block_size),
        )?;
        gauge(
            &mut enc,
            "queue_depth",
            "Requests waiting for admission",
            get(&m.queue_depth),
        )?;
        gauge(
            &mut enc,
            "running_sequences",
            "Sequences admitted and not finished",
            get(&m.running),
        )?;
        gauge(
            &mut enc,
            "batch_size",
            "Sequences in the last forward step",
            get(&m.last_batch_size),
        )?;
        counter(&mut enc, "steps", "Forward steps", get(&m.steps))?;
        counter(
            &mut enc,
            "step_tokens",
            "Tokens in forward steps (decode + prefill)",
            get(&m.step_tokens),
        )?;
        counter(
            &mut enc,
            "prefill_tokens",
            "Prompt tokens computed",
            get(&m.prefill_tokens),
        )?;
        counter(
            &mut enc,
            "cached_prompt_tokens",
            "Prompt tokens served from slots",
            get(&m.cached_prompt_tokens),
        )?;
        counter(
            &mut enc,
            "decode_tokens",
            "Tokens generated",
            get(&m.decode_tokens),
        )?;
        {
            let buckets: Vec<(f64, u64)> = BATCH_SIZE_BUCKETS
                .iter()
                .map(|&b| b as f64)
                .chain(std::iter::once(f64::INFINITY))
                .zip(m.batch_size_buckets.iter().map(get))
                .collect();
            let count: u64 = buckets.iter().map(|b| b.1).sum();
            enc.encode_descriptor(
                "step_batch_size",
                "Sequences per forward step",
                None,
                MetricType::Histogram,
            )?
            .encode_histogram::<prometheus_client::encoding::NoLabelSet>(
                get(&m.batch_size_sum) as f64,
                count,
                &buckets,
                None,
            )?;
        }
        {
            let buckets: Vec<(f64, u64)> = TTFT_BUCKETS_NS
                .iter()
                .map(|&b| b as f64 / 1e9)
                .chain(std::iter::once(f64::INFINITY))
                .zip(m.ttft_buckets.iter().map(get))
                .collect();
            enc.encode_descriptor(
                "engine_time_to_first_token_seconds",
                "Admission to first generated token, inside the engine",
                None,
                MetricType::Histogram,
            )?
            .encode_histogram::<prometheus_client::encoding::NoLabelSet>(
                get(&m.ttft_ns_sum) as f64 / 1e9,
                get(&m.ttft_count),
                &buckets,
                None,
            )?;
        }
        enc.encode_descriptor(
            "step_seconds",
            "Wall time in forward steps",
            None,
            MetricType::Counter,
        )?
        .encode_counter::<prometheus_client::encoding::NoLabelSet, _, u64>(
            &(get(&m.step_ns_sum) as f64 / 1e9),
            None,
        )?;
        Ok(())
    }
}

/// Registers the engine's counters in `registry`.
pub fn register_engine_metrics(registry: &mut Registry, metrics: Arc<EngineMetrics>) {
    registry.register_collector(Box::new(EngineCollector(metrics)));
}
