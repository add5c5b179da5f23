//! The decision: admit or limit one request of a caller, exactly, through the ledger.
//!
//! "Limited" is a value ([`Outcome::Limited`]), not an error. A ledger that fails or is too slow
//! yields [`Outcome::FailedOpen`] or [`Outcome::FailedClosed`] according to the configured
//! [`FailurePolicy`]; a decision never takes longer than the ledger deadline.

use std::num::NonZeroU64;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use crate::caller::CallerKey;
use crate::ledger::{model, AccountView, HoldOutcome, Ledger, LedgerError};
use crate::local_view::{LocalQuota, LocalView};
use crate::metrics::{DecisionMetrics, DecisionSource};
use crate::plan::{PlanBook, PlanId};

/// What to do when the ledger cannot decide in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailurePolicy {
    /// Admit the request (availability over exactness).
    Open,
    /// Refuse it with 503 (exactness over availability).
    Closed,
}

#[derive(Debug, Clone)]
pub struct LimiterSettings {
    /// The deadline for one whole decision, provisioning included.
    pub ledger_timeout: Duration,
    pub failure_policy: FailurePolicy,
    /// How many callers this instance remembers holds for (headers and local 429s).
    pub local_callers_max: usize,
    /// Added to every expiry this instance computes: TigerBeetle releases a hold a little after it
    /// is due (~5 ms typically, at most ~100 ms).
    pub expiry_margin: Duration,
}

/// The quota a response advertises (IETF `RateLimit` / `RateLimit-Policy` fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    pub limit: u64,
    pub window_seconds: u32,
    pub remaining: u64,
    pub reset_seconds: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Admitted,
    Limited {
        /// Whole seconds until enough credit is back for this cost (rounded up, at least 1).
        retry_after_seconds: u64,
        source: DecisionSource,
    },
    FailedOpen(LedgerError),
    FailedClosed(LedgerError),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub outcome: Outcome,
    pub plan: PlanId,
    /// The caller's account in the ledger: a non-secret id, safe for traces.
    pub account_id: u128,
    pub quota: Quota,
}

/// Shared by every worker: one ledger client, one local view.
pub struct Limiter {
    ledger: Ledger,
    plans: Arc<PlanBook>,
    settings: LimiterSettings,
    local: LocalView,
    decisions: DecisionMetrics,
}

impl std::fmt::Debug for Limiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiter")
            .field("ledger", &self.ledger)
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

static FAILURE_LOGGED_SECOND: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn whole_seconds_up(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

impl Limiter {
    /// Install the `metrics` recorder first: the decision counters bind to it here.
    pub fn new(ledger: Ledger, plans: Arc<PlanBook>, settings: LimiterSettings) -> Self {
        let local = LocalView::new(settings.local_callers_max, settings.expiry_margin);
        let decisions = DecisionMetrics::register(&plans);
        Limiter {
            ledger,
            plans,
            settings,
            local,
            decisions,
        }
    }

    pub fn plans(&self) -> &PlanBook {
        &self.plans
    }

    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    pub fn settings(&self) -> &LimiterSettings {
        &self.settings
    }

    /// The decision counters (registered with the recorder installed when the limiter was made).
    pub fn decision_metrics(&self) -> &DecisionMetrics {
        &self.decisions
    }

    /// Decides one request of `cost` units for `key` on `plan`.
    pub async fn check(&self, key: &CallerKey, plan_id: PlanId, cost: NonZeroU64) -> Decision {
        let plan = self.plans.get(plan_id);
        let capacity = plan.capacity().get();
        let window_seconds = plan.window_seconds().get();
        let account_id = model::user_account_id(self.ledger.ledger_id(), plan, key);
        let cost = cost.get();
        let quota = |local: LocalQuota| Quota {
            limit: capacity,
            window_seconds,
            remaining: local.remaining,
            reset_seconds: whole_seconds_up(local.reset_after),
        };
        let decision = |outcome: Outcome, local: LocalQuota| Decision {
            outcome,
            plan: plan_id,
            account_id,
            quota: quota(local),
        };

        let started = Instant::now();
        if let Some(limit) = self.local.check(account_id, cost, started) {
            return decision(
                Outcome::Limited {
                    retry_after_seconds: whole_seconds_up(limit.retry_after).max(1),
                    source: DecisionSource::LocalCache,
                },
                limit.quota,
            );
        }

        let deadline = started + self.settings.ledger_timeout;
        let void_if_abandoned = self.settings.failure_policy == FailurePolicy::Closed;
        let window_seconds_max = self.plans.window_seconds_max().get();
        // At most one provisioning and one retry per decision: bounded work, within the deadline.
        let mut provisioned = false;
        let mut retried = false;
        loop {
            let result = self
                .ledger
                .hold(
                    account_id,
                    cost,
                    window_seconds,
                    deadline,
                    void_if_abandoned,
                )
                .await;
            match result {
                Ok(HoldOutcome::Held { answered_at }) => {
                    let local = self.local.record_hold(
                        account_id,
                        capacity,
                        cost,
                        answered_at,
                        Duration::from_secs(window_seconds.into()),
                        Instant::now(),
                    );
                    return decision(Outcome::Admitted, local);
                }
                Ok(HoldOutcome::AccountNotFound) if !provisioned => {
                    if let Err(error) = self.ledger.provision(account_id, plan, deadline).await {
                        return self.fail(error, account_id, capacity, decision);
                    }
                    tracing::debug!(account_id = %format_args!("{account_id:032x}"), "provisioned");
                    provisioned = true;
                }
                Ok(HoldOutcome::AccountNotFound) => {
                    let error = LedgerError::Unexpected {
                        operation: crate::metrics::Operation::CreateTransfers,
                        message: "account not found right after provisioning".to_owned(),
                    };
                    self.ledger.metrics().record_error(error.kind());
                    return self.fail(error, account_id, capacity, decision);
                }
                Ok(HoldOutcome::ExceedsCredits) => {
                    let view = self
                        .ledger
                        .account_view(account_id, window_seconds_max, deadline)
                        .await;
                    if !retried {
                        match &view {
                            Ok(Some(v)) if v.credit == 0 => {
                                // The account exists but its grant has not landed yet: another
                                // request is provisioning this new caller right now. Provisioning
                                // is idempotent, so finish it here too (then the grant is surely
                                // committed), and retry.
                                if let Err(error) =
                                    self.ledger.provision(account_id, plan, deadline).await
                                {
                                    return self.fail(error, account_id, capacity, decision);
                                }
                                retried = true;
                                continue;
                            }
                            // Credit came back (or was granted) between the two calls: the
                            // ledger would admit now, so ask it again rather than refuse.
                            Ok(Some(v)) if v.available >= cost => {
                                retried = true;
                                continue;
                            }
                            _ => {}
                        }
                    }
                    let retry_after = self.retry_after(account_id, cost, view);
                    let local = self.local.quota(account_id, capacity, Instant::now());
                    return decision(
                        Outcome::Limited {
                            retry_after_seconds: whole_seconds_up(retry_after).max(1),
                            source: DecisionSource::Ledger,
                        },
                        LocalQuota {
                            remaining: 0,
                            ..local
                        },
                    );
                }
                Err(error) => return self.fail(error, account_id, capacity, decision),
            }
        }
    }

    fn fail(
        &self,
        error: LedgerError,
        account_id: u128,
        capacity: u64,
        decision: impl Fn(Outcome, LocalQuota) -> Decision,
    ) -> Decision {
        // On the request's span always; in the log at most once a second (an outage must not
        // turn into a log flood).
        tracing::warn!(target: crate::telemetry::SPAN_EVENTS_TARGET, %error, "ledger could not decide");
        if crate::telemetry::log_throttle(&FAILURE_LOGGED_SECOND) {
            tracing::warn!(%error, policy = ?self.settings.failure_policy, "ledger could not decide; applying the failure policy (logged at most once a second)");
        }
        let local = self.local.quota(account_id, capacity, Instant::now());
        let outcome = match self.settings.failure_policy {
            FailurePolicy::Open => Outcome::FailedOpen(error),
            FailurePolicy::Closed => Outcome::FailedClosed(error),
        };
        decision(outcome, local)
    }

    /// When enough credit comes back, from what the ledger said of the account; remembered, so the
    /// next requests of this exhausted caller are answered locally. If the ledger could not say
    /// within the deadline, the longest window is a safe answer: every current hold is released by
    /// then.
    fn retry_after(
        &self,
        account_id: u128,
        cost: u64,
        view: Result<Option<AccountView>, LedgerError>,
    ) -> Duration {
        let window_max = Duration::from_secs(self.plans.window_seconds_max().get().into());
        let fallback = window_max + self.settings.expiry_margin;
        match view {
            Ok(Some(view)) => {
                let now = Instant::now();
                self.local
                    .replace(account_id, &view, window_max, now, SystemTime::now());
                match self.local.check(account_id, cost, now) {
                    Some(limit) => limit.retry_after,
                    // Holds expired between the two calls: credit is back already.
                    None => Duration::ZERO,
                }
            }
            Ok(None) => fallback,
            Err(error) => {
                tracing::debug!(%error, "could not read holds; Retry-After falls back to the window");
                fallback
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_round_up() {
        assert_eq!(whole_seconds_up(Duration::ZERO), 0);
        assert_eq!(whole_seconds_up(Duration::from_millis(1)), 1);
        assert_eq!(whole_seconds_up(Duration::from_secs(2)), 2);
        assert_eq!(whole_seconds_up(Duration::from_millis(2001)), 3);
    }
}
