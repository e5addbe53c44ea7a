//! Request preparation on the caller's thread: validation, tokenisation per message, message
//! identities, the prompt hash, the handle's cheap checks and the prompt safety check. The
//! scheduler thread receives a [`Prepared`] request and only does slot work and forward steps.

use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use zerolayer_handle::{KeyRing, PromptHash, TenantTag, Unverified};
use zerolayer_model::{SamplingParams, Tokenizer};

use crate::api::{Caller, GenerateRequest, Role, Truncation};
use crate::error::EngineError;
use crate::safety::TenantSafety;

/// Most stop sequences per request (the service edge allows the same; OpenAI allows 4).
pub const MAX_STOP_SEQUENCES: usize = 8;
/// Longest stop sequence in bytes (the service edge's limit; text this long is held back).
pub const MAX_STOP_BYTES: usize = 64;
/// Most messages per request (the service edge's limit).
pub const MAX_MESSAGES: usize = 1024;

/// Keyed hash identifying a message by (role, content), for the slot's tracked messages.
/// BLAKE3 keyed with a per-engine random key, truncated to 64 bits: clients cannot construct
/// collisions without the key, and a collision could only ever affect their own conversation.
#[derive(Clone)]
pub(crate) struct MessageHasher {
    /// Random per-engine key.
    key: [u8; 32],
}

impl std::fmt::Debug for MessageHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MessageHasher(..)")
    }
}

impl MessageHasher {
    /// A hasher with a fresh random key.
    pub(crate) fn random() -> Result<Self, EngineError> {
        let mut key = [0u8; 32];
        getrandom::fill(&mut key).map_err(|e| EngineError::Internal {
            reason: format!("no entropy: {e}"),
        })?;
        Ok(Self { key })
    }

    /// Identity of a message.
    pub(crate) fn hash(&self, role: Role, content: &str) -> u64 {
        let mut h = blake3::Hasher::new_keyed(&self.key);
        h.update(&[role_byte(role)]);
        h.update(content.as_bytes());
        let out = h.finalize();
        let mut b = [0u8; 8];
        b.copy_from_slice(&out.as_bytes()[..8]);
        u64::from_le_bytes(b)
    }
}

/// Stable byte per role (part of the message identity).
fn role_byte(r: Role) -> u8 {
    match r {
        Role::System => 1,
        Role::User => 2,
        Role::Assistant => 3,
    }
}

/// A validated, tokenised request on its way to the scheduler.
#[derive(Debug)]
pub(crate) struct Prepared {
    /// The caller's tenant tag (handles must carry it).
    pub tenant: TenantTag,
    /// Correlation id for logs.
    pub request_id: String,
    /// Delta mode.
    pub delta: bool,
    /// Full mode: BOS then each message's ids. Delta mode: the new messages' ids only.
    pub ids: Vec<u32>,
    /// End offset in `ids` of each message.
    pub ends: Vec<u32>,
    /// Identity hash of each message.
    pub hashes: Vec<u64>,
    /// Full mode: offset after BOS and the system message (kept by left truncation).
    pub keep_prefix: u32,
    /// Full mode: the conversation's prompt hash.
    pub prompt_hash: Option<PromptHash>,
    /// The presented handle after its cheap checks.
    pub handle: Option<Unverified>,
    /// Explicit `max_tokens`.
    pub max_tokens: Option<u32>,
    /// Sampling parameters (seed fixed).
    pub sampling: SamplingParams,
    /// Stop sequences.
    pub stop: Vec<String>,
    /// Context-length policy.
    pub truncation: Truncation,
    /// The tenant's safety rules.
    pub safety: Option<Arc<TenantSafety>>,
    /// When `generate` was called.
    pub submitted: Instant,
}

/// Unix seconds now.
pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// What [`prepare`] needs from the engine.
pub(crate) struct PrepareContext<'a> {
    /// The model tokenizer.
    pub tokenizer: &'a Tokenizer,
    /// Handle keys.
    pub keys: &'a KeyRing,
    /// Message identities.
    pub hasher: &'a MessageHasher,
    /// The caller tenant's safety rules.
    pub safety: Option<Arc<TenantSafety>>,
    /// Whether reuse (and so handles) is enabled.
    pub reuse: bool,
}

/// Validates and tokenises `req` for `caller`.
pub(crate) fn prepare(
    cx: PrepareContext<'_>,
    caller: &Caller,
    req: GenerateRequest,
) -> Result<Prepared, EngineError> {
    let submitted = Instant::now();
    let GenerateRequest {
        messages,
        handle,
        delta,
        sampling,
        truncation,
        request_id,
    } = req;
    if messages.is_empty() {
        return Err(EngineError::invalid("at least one message is required"));
    }
    if messages.len() > MAX_MESSAGES {
        return Err(EngineError::invalid(format!(
            "{} messages exceed the limit of {MAX_MESSAGES}",
            messages.len()
        )));
    }
    if let Some(i) = messages.iter().position(|m| m.role == Role::System)
        && (i > 0 || delta)
    {
        return Err(EngineError::invalid(format!(
            "message {i}: a system message may only open a full transcript"
        )));
    }
    if sampling.max_tokens == Some(0) {
        return Err(EngineError::invalid("max_tokens must be at least 1"));
    }
    if sampling.stop.len() > MAX_STOP_SEQUENCES {
        return Err(EngineError::invalid(format!(
            "{} stop sequences exceed the limit of {MAX_STOP_SEQUENCES}",
            sampling.stop.len()
        )));
    }
    if let Some(s) = sampling
        .stop
        .iter()
        .find(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
    {
        return Err(EngineError::invalid(format!(
            "stop sequences must be 1..={MAX_STOP_BYTES} bytes (got {})",
            s.len()
        )));
    }
    let seed = match sampling.seed {
        Some(s) => s,
        None => {
            let mut b = [0u8; 8];
            getrandom::fill(&mut b).map_err(|e| EngineError::Internal {
                reason: format!("no entropy: {e}"),
            })?;
            u64::from_le_bytes(b)
        }
    };
    let params = SamplingParams::new(sampling.temperature, sampling.top_k, sampling.top_p, seed)?;
    if delta && handle.is_none() {
        return Err(EngineError::invalid("delta mode requires a context handle"));
    }
    if let Some(safety) = &cx.safety
        && let Some(i) = safety.first_violation(messages.iter().map(|m| m.content.as_str()))
    {
        return Err(EngineError::SafetyViolation {
            message_index: i as u32,
        });
    }
    let tenant = TenantTag::for_tenant(&caller.tenant);
    // The layered baseline ignores handles (it never issued any); delta mode then cannot work.
    let handle = match handle {
        Some(bytes) if cx.reuse => Some(cx.keys.precheck(&bytes, &tenant, unix_now())?),
        Some(_) if delta => {
            return Err(EngineError::ContextEvicted {
                why: "KV reuse is disabled on this engine",
            });
        }
        _ => None,
    };
    let mut ids = Vec::new();
    if !delta {
        ids.push(cx.tokenizer.bos_id());
    }
    let mut ends = Vec::with_capacity(messages.len());
    let mut hashes = Vec::with_capacity(messages.len());
    for m in &messages {
        ids.extend(cx.tokenizer.encode_message(&m.content));
        ends.push(ids.len() as u32);
        hashes.push(cx.hasher.hash(m.role, &m.content));
    }
    let (keep_prefix, prompt_hash) = if delta {
        (0, None)
    } else {
        let system = messages.first().filter(|m| m.role == Role::System);
        let first_user = messages
            .iter()
            .find(|m| m.role == Role::User)
            .map_or("", |m| m.content.as_str());
        let hash = PromptHash::compute(
            &caller.tenant,
            system.map_or("", |m| m.content.as_str()),
            first_user,
        );
        (if system.is_some() { ends[0] } else { 1 }, Some(hash))
    };
    Ok(Prepared {
        tenant,
        request_id,
        delta,
        ids,
        ends,
        hashes,
        keep_prefix,
        prompt_hash,
        handle,
        max_tokens: sampling.max_tokens,
        sampling: params,
        stop: sampling.stop,
        truncation,
        safety: cx.safety,
        submitted,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{Message, SamplingOptions};

    fn cx<'a>(
        tok: &'a Tokenizer,
        keys: &'a KeyRing,
        hasher: &'a MessageHasher,
    ) -> PrepareContext<'a> {
        PrepareContext {
            tokenizer: tok,
            keys,
            hasher,
            safety: None,
            reuse: true,
        }
    }

    fn req(messages: Vec<Message>) -> GenerateRequest {
        GenerateRequest {
            messages,
            handle: None,
            delta: false,
            sampling: SamplingOptions::default(),
            truncation: Truncation::Reject,
            request_id: String::new(),
        }
    }

    #[test]
    fn message_identity_covers_role_and_content_under_a_per_engine_key() {
        let (a, b) = (
            MessageHasher::random().unwrap(),
            MessageHasher::random().unwrap(),
        );
        assert_eq!(a.hash(Role::User, "hi"), a.hash(Role::User, "hi"));
        assert_ne!(a.hash(Role::User, "hi"), a.hash(Role::Assistant, "hi"));
        assert_ne!(a.hash(Role::User, "hi"), a.hash(Role::User, "hi!"));
        assert_ne!(a.hash(Role::User, "hi"), b.hash(Role::User, "hi"));
    }

    #[test]
    fn full_transcripts_are_tokenised_per_message_after_bos() {
        let tok = Tokenizer::byte_level(512).unwrap();
        let keys = KeyRing::new(zerolayer_handle::SigningKey::from_seed(1, &[1; 32]));
        let hasher = MessageHasher::random().unwrap();
        let messages = vec![
            Message::new(Role::System, "be brief"),
            Message::new(Role::User, "hi"),
            Message::new(Role::Assistant, "yo"),
        ];
        let p = prepare(
            cx(&tok, &keys, &hasher),
            &Caller::new("acme"),
            req(messages),
        )
        .unwrap();
        let rendered = tok.render_messages(&[("s", "be brief"), ("u", "hi"), ("a", "yo")]);
        assert_eq!(p.ids, rendered);
        assert_eq!(p.ends, [10, 13, 16]);
        assert_eq!(p.keep_prefix, 10, "BOS and the system message");
        assert_eq!(
            p.prompt_hash,
            Some(PromptHash::compute("acme", "be brief", "hi"))
        );
    }

    #[test]
    fn delta_requests_carry_only_the_new_messages_and_need_a_handle() {
        let tok = Tokenizer::byte_level(512).unwrap();
        let keys = KeyRing::new(zerolayer_handle::SigningKey::from_seed(1, &[1; 32]));
        let hasher = MessageHasher::random().unwrap();
        let mut r = req(vec![Message::new(Role::User, "more")]);
        r.delta = true;
        let e = prepare(cx(&tok, &keys, &hasher), &Caller::new("acme"), r).unwrap_err();
        assert_eq!(e.reason(), crate::api::ErrorReason::InvalidRequest);
    }
}
