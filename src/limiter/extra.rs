//! A request charged against its caller's plan **and** a route's further limits at once (for
//! example 10 per second and 10,000 per day), atomically: one linked chain of holds
//! ([`Limiter::check_all`]), so a request either passes every limit or consumes none.
//!
//! A route limit is a [`Plan`] that no key is assigned to; each caller has its own account on it
//! (derived from `+<limit name>`, a name no plan can have, its capacity and the key).

use std::num::NonZeroU64;
use std::time::Instant;

use super::caller::{CallerKey, KeyError};
use super::multi::{Limit, MultiDecision};
use super::plan::Plan;
use super::store::{Clock, Store};
use super::{moves, Decision, DecisionSource, HoldReceipt, Limiter, Outcome, Quota, RenewalAhead};
use crate::ledger::model::{self, UserAccount};
use crate::telemetry::span::fields;

/// At most this many limits on a route besides the caller's plan.
pub const ROUTE_LIMITS_MAX: usize = 8;

/// What one of a route's limits says of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteLimitStatus {
    pub limit: Plan,
    pub account_id: u128,
    pub quota: Quota,
    /// This limit's hold (admitted requests): a refund voids it with the plan's.
    pub hold: Option<HoldReceipt>,
}

/// The caller's account on a route limit.
pub fn route_limit_account(ledger_id: u32, limit: &Plan, key: &CallerKey) -> UserAccount {
    let name = format!("+{}", limit.name());
    let key = key.expose_secret().as_bytes();
    UserAccount {
        id: model::user_account_id(ledger_id, &name, limit.capacity(), key),
        capacity: limit.capacity(),
        window_seconds: limit.window_seconds(),
    }
}

impl<S: Store, C: Clock> Limiter<S, C> {
    /// [`Limiter::check`] against the caller's plan and every limit of `route_limits` (at most
    /// twice [`ROUTE_LIMITS_MAX`]: a route's, or two routes'), all or none.
    /// [`Decision::refused_by`] names the limit that refused.
    ///
    /// Unlike [`Limiter::check`], it leaves the renewal ahead of need that an admission from a
    /// lease made due to its caller, to run after answering ([`Limiter::renew_lease_ahead`]):
    /// the request need not wait for the ledger. Dropped unrun, the renewal ends, and a later
    /// request starts it again. (A route with further limits is decided per request: none.)
    pub async fn check_with(
        &self,
        key: &CallerKey,
        cost: NonZeroU64,
        route_limits: &[Plan],
    ) -> Result<(Decision<'_>, Option<RenewalAhead>), KeyError> {
        let deadline = self.deadline();
        self.check_with_by(key, cost, route_limits, deadline).await
    }

    /// [`Limiter::check_with`] with every ledger call answered by `deadline`
    /// ([`Limiter::check_by`] says why).
    pub async fn check_with_by(
        &self,
        key: &CallerKey,
        cost: NonZeroU64,
        route_limits: &[Plan],
        deadline: Instant,
    ) -> Result<(Decision<'_>, Option<RenewalAhead>), KeyError> {
        if route_limits.is_empty() {
            return self.check_leaving_renewal(key, cost, deadline).await;
        }
        // Boxed: the all-or-none chain's future is large, and most routes have no further limits.
        let decision = Box::pin(self.check_with_limits(key, cost, route_limits, deadline)).await?;
        Ok((decision, None))
    }

    async fn check_with_limits(
        &self,
        key: &CallerKey,
        cost: NonZeroU64,
        route_limits: &[Plan],
        deadline: Instant,
    ) -> Result<Decision<'_>, KeyError> {
        // Each route's validated by the rules; a path's two forms may be on two routes (an
        // escaped `/`, `http::rules::decoded_path`), whose limits both apply.
        assert!(
            route_limits.len() <= 2 * ROUTE_LIMITS_MAX,
            "validated by the rules"
        );
        let mut followed = 0;
        loop {
            let Some(charge) = self.charge(key, cost) else {
                self.reject_key();
                return Err(KeyError::Unknown);
            };
            let ledger_id = self.store.ledger_id();
            let mut limits = vec![Limit {
                account: charge.account,
                cost: cost.get(),
                local_view: true,
                lease: charge.plan.lease(),
            }];
            limits.extend(route_limits.iter().map(|limit| Limit {
                account: route_limit_account(ledger_id, limit, key),
                cost: cost.get(),
                local_view: true,
                lease: None,
            }));
            let multi = self
                .check_all_by(&limits, deadline)
                .await
                .expect("at most 1 + 2 × ROUTE_LIMITS_MAX distinct accounts");
            // The plan's account closed: a block, or a move this instance has not learnt yet (as
            // the refusal's own read of the account says: a second read had a deadline of its
            // own, and a blocked caller's decision took two).
            if followed < moves::moves_followed_max(&self.plans) && closed_by_ledger(&multi) {
                if let Some(plan) = multi
                    .moved_to
                    .and_then(|tag| moves::plan_of_tag(&self.plans, tag))
                {
                    self.moves
                        .learn(charge.home_account_id, plan, charge.home_plan_id);
                    followed += 1;
                    continue;
                }
            }
            let decision = self.multi_decision(multi, &charge, route_limits, &limits);
            self.record(&decision, key, cost);
            // A lease plan under route limits holds per request (the chain): counted in the
            // transfers per admitted request as the per-request path counts its own, which read
            // low on such routes.
            if decision.plan.lease().is_some() && decision.hold.is_some() {
                self.leases.count_transfers(decision.plan_id, 1);
            }
            self.record_route_limit(&decision);
            return Ok(decision);
        }
    }

    fn multi_decision<'a>(
        &'a self,
        mut multi: MultiDecision,
        charge: &super::Charge<'a>,
        route_limits: &[Plan],
        limits: &[Limit],
    ) -> Decision<'a> {
        let statuses = multi.limits.split_off(1);
        let plan = multi.limits.pop().expect("the plan's status");
        let route_limits = route_limits
            .iter()
            .zip(statuses)
            .zip(&limits[1..])
            .map(|((limit, status), account)| RouteLimitStatus {
                limit: limit.clone(),
                account_id: account.account.id,
                quota: status.quota,
                hold: status.hold,
            })
            .collect();
        Decision {
            outcome: multi.outcome,
            plan: charge.plan,
            plan_id: charge.plan_id,
            account_id: charge.account.id,
            quota: plan.quota,
            hold: plan.hold,
            leased: None,
            route_limits,
            refused_by: multi.refused_by.and_then(|index| index.checked_sub(1)),
        }
    }

    /// Counts a refusal by a route limit, and names the limit on the request's span.
    fn record_route_limit(&self, decision: &Decision<'_>) {
        let Some(index) = decision.refused_by else {
            return;
        };
        let limit = &decision.route_limits[index].limit;
        self.decisions.record_route_limit_refusal(limit.name());
        tracing::Span::current().record(fields::LIMIT, limit.name());
    }
}

fn closed_by_ledger(multi: &MultiDecision) -> bool {
    let blocked = matches!(
        multi.outcome,
        Outcome::Blocked {
            source: DecisionSource::Ledger,
            ..
        }
    );
    blocked && multi.refused_by == Some(0)
}
