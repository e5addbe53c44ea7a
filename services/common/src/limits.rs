//! Per-tenant admission: a token bucket (tokens/s) and a concurrency limit, plus a
//! process-wide in-flight cap for load shedding.
//!
//! Token accounting: a request is admitted while its tenant's bucket is not in debt; it
//! reserves `max_tokens` up front and is settled with its real cost (prefilled + generated
//! tokens — cached prompt tokens are free, which is the point of zerolayer) when it ends. The
//! bucket may go negative on settlement; the next request then waits for the refill and gets
//! `RATE_LIMIT_EXCEEDED` with a `retry-after-ms` hint.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use zerolayer_engine::api::ErrorReason;

use crate::{error::ApiError, tenants::TenantPolicy};

/// Default cap on requests in flight in one serving process before it sheds load.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 1024;

#[derive(Debug)]
struct TenantState {
    /// Tokens available (may be negative: debt from settled requests).
    tokens: f64,
    /// Last refill.
    refilled: Instant,
    /// Requests of this tenant in flight.
    in_flight: u32,
}

/// Admission control shared by every request of one serving process.
#[derive(Debug)]
pub struct Limiter {
    tenants: Mutex<HashMap<String, TenantState>>,
    in_flight: AtomicUsize,
    max_in_flight: usize,
}

impl Limiter {
    /// A limiter shedding load above `max_in_flight` concurrent requests.
    pub fn new(max_in_flight: usize) -> Arc<Self> {
        Arc::new(Self {
            tenants: Mutex::new(HashMap::new()),
            in_flight: AtomicUsize::new(0),
            max_in_flight: max_in_flight.max(1),
        })
    }

    /// Requests in flight now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Admits a request reserving `reserve_tokens`, or explains why not.
    pub fn admit(
        self: &Arc<Self>,
        policy: &Arc<TenantPolicy>,
        reserve_tokens: u32,
    ) -> Result<Admission, ApiError> {
        self.check(policy, true, reserve_tokens)?;
        Ok(Admission {
            limiter: self.clone(),
            policy: policy.clone(),
            reserved: f64::from(reserve_tokens),
            settled: false,
        })
    }

    /// Runs the same checks as [`Self::admit`] without taking anything (the `Validate` RPC).
    pub fn check_only(&self, policy: &TenantPolicy) -> Result<(), ApiError> {
        self.check(policy, false, 0)
    }

    fn check(&self, policy: &TenantPolicy, take: bool, reserve: u32) -> Result<(), ApiError> {
        if self.in_flight.load(Ordering::Relaxed) >= self.max_in_flight {
            return Err(ApiError::new(
                ErrorReason::Overloaded,
                format!(
                    "server is shedding load: {} requests in flight",
                    self.max_in_flight
                ),
            )
            .with_retry_after(Duration::from_millis(100)));
        }
        // A poisoned lock only means another request panicked mid-update of plain numbers;
        // the numbers are still usable.
        let mut tenants = self.tenants.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let state = tenants
            .entry(policy.name.clone())
            .or_insert_with(|| TenantState {
                tokens: policy.burst(),
                refilled: now,
                in_flight: 0,
            });
        if policy.max_concurrency > 0 && state.in_flight >= policy.max_concurrency {
            return Err(ApiError::new(
                ErrorReason::RateLimitExceeded,
                format!(
                    "tenant {} has {} requests in flight (limit {})",
                    policy.name, state.in_flight, policy.max_concurrency
                ),
            )
            .with_retry_after(Duration::from_millis(50)));
        }
        let rate = policy.rate_limit_tokens_per_s;
        if rate > 0.0 {
            let elapsed = now.duration_since(state.refilled).as_secs_f64();
            state.tokens = (state.tokens + elapsed * rate).min(policy.burst());
            state.refilled = now;
            if state.tokens <= 0.0 {
                let wait = Duration::from_secs_f64((1.0 - state.tokens) / rate);
                return Err(ApiError::new(
                    ErrorReason::RateLimitExceeded,
                    format!("tenant {} exceeded {rate} tokens/s", policy.name),
                )
                .with_retry_after(wait));
            }
            if take {
                state.tokens -= f64::from(reserve);
            }
        }
        if take {
            state.in_flight += 1;
            self.in_flight.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    fn release(&self, policy: &TenantPolicy, reserved: f64, actual: Option<f64>) {
        let mut tenants = self.tenants.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(state) = tenants.get_mut(&policy.name) {
            state.in_flight = state.in_flight.saturating_sub(1);
            if policy.rate_limit_tokens_per_s > 0.0 {
                // Replace the reservation by the real cost (unsettled: keep the reservation).
                state.tokens += reserved - actual.unwrap_or(reserved);
                state.tokens = state.tokens.min(policy.burst());
            }
        }
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// An admitted request. Dropping it releases the concurrency slot; [`Admission::settle`]
/// first replaces the token reservation by the real cost.
#[derive(Debug)]
pub struct Admission {
    limiter: Arc<Limiter>,
    policy: Arc<TenantPolicy>,
    reserved: f64,
    settled: bool,
}

impl Admission {
    /// Charges the real cost (prefilled + generated tokens) and releases the request.
    pub fn settle(mut self, cost_tokens: u32) {
        self.settled = true;
        self.limiter
            .release(&self.policy, self.reserved, Some(f64::from(cost_tokens)));
    }

    /// The tenant this admission belongs to.
    pub fn tenant(&self) -> &Arc<TenantPolicy> {
        &self.policy
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        if !self.settled {
            self.limiter.release(&self.policy, self.reserved, None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(rate: f64, burst: u64, concurrency: u32) -> Arc<TenantPolicy> {
        Arc::new(TenantPolicy {
            rate_limit_tokens_per_s: rate,
            burst_tokens: burst,
            max_concurrency: concurrency,
            ..TenantPolicy::unlimited("t")
        })
    }

    #[test]
    fn concurrency_limit_rejects_the_request_above_the_limit_and_frees_on_drop() {
        let limiter = Limiter::new(100);
        let p = policy(0.0, 0, 2);
        let a = limiter.admit(&p, 1).expect("first");
        let _b = limiter.admit(&p, 1).expect("second");
        let err = limiter.admit(&p, 1).expect_err("third");
        assert_eq!(err.reason, ErrorReason::RateLimitExceeded);
        drop(a);
        limiter.admit(&p, 1).expect("slot freed");
    }

    #[test]
    fn token_bucket_rejects_a_tenant_in_debt_with_a_retry_hint() {
        let limiter = Limiter::new(100);
        // 1 token/s refill: the test cannot see a meaningful refill in its run time.
        let p = policy(1.0, 100, 0);
        limiter.admit(&p, 10).expect("within burst").settle(500);
        let err = limiter.admit(&p, 10).expect_err("in debt");
        assert_eq!(err.reason, ErrorReason::RateLimitExceeded);
        assert!(err.retry_after.expect("hint") >= Duration::from_secs(300));
        // Validate-style checks see the same state without taking anything.
        assert!(limiter.check_only(&p).is_err());
    }

    #[test]
    fn unsettled_admissions_keep_their_reservation() {
        let limiter = Limiter::new(100);
        let p = policy(1.0, 100, 0);
        // Reserving more than the bucket holds leaves it 50 tokens in debt; at 1 token/s
        // the refill during the test cannot pay that back.
        drop(limiter.admit(&p, 150).expect("bucket not in debt yet"));
        assert!(limiter.admit(&p, 1).is_err(), "reservation was charged");
    }

    #[test]
    fn the_in_flight_cap_sheds_load_with_overloaded() {
        let limiter = Limiter::new(1);
        let p = policy(0.0, 0, 0);
        let _a = limiter.admit(&p, 1).expect("first");
        assert_eq!(
            limiter.admit(&p, 1).expect_err("shed").reason,
            ErrorReason::Overloaded
        );
        assert_eq!(limiter.in_flight(), 1);
    }
}
