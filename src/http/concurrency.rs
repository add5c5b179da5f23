//! Concurrency limits: at most N requests of one caller in flight on a route, across every
//! instance. A request takes a slot (a hold on the concurrency ledger, one account per caller and
//! route) before its handler runs, and gives it back (a void) when the response's body has been
//! sent, a streamed one included (`slot_body.rs`), or when the request is dropped (client gone,
//! handler panicked). A slot that an instance could not give back (it died) is released by the
//! hold's timeout, `timeout_seconds`.

use std::num::{NonZeroU32, NonZeroU64};
use std::sync::Arc;
use std::time::Instant;

use thiserror::Error;

use actix_web::HttpResponse;

use super::problem::{self, ProblemKind};
use super::rules::{decoded_path, is_route_pattern, most_specific_first, path_matches};
use crate::ledger::{model, Ledger};
use crate::limiter::caller::CallerKey;
use crate::limiter::metrics::{DecisionLabel, CONCURRENCY_PLAN_PREFIX};
use crate::limiter::plan::{Plan, PlanBook, PlanError, UnknownKeys};
use crate::limiter::{Decision, HoldReceipt, Limiter, LimiterSettings, Outcome};
use crate::outstanding::{OutGuard, Outstanding};
use crate::telemetry::span::fields;

/// The plan (and so the account and the `plan` metric label) of a route's concurrency limit:
/// named from the pattern itself, so that adding or removing another route, on one instance of
/// a rolling deploy, never moves this route's slots to another account.
pub fn plan_name(pattern: &str) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(pattern.as_bytes());
    format!("{CONCURRENCY_PLAN_PREFIX}{}", hex::encode(&digest[..4]))
}

/// The concurrency limits of a service, one per route pattern (exact path or `prefix*`).
#[derive(Default)]
pub struct ConcurrencyLimits {
    routes: Vec<(String, Arc<Limiter>)>,
    /// The slots handed out and not given back yet ([`Outstanding`]).
    out: Outstanding,
}

/// A slot's give-back, run as a task on the runtime its slot is dropped on. Dropped unfinished
/// (that runtime shutting down, or none there), it is sent again from its limits' fallback
/// runtime, once.
struct GiveBack {
    limiter: Arc<Limiter>,
    account_id: u128,
    hold: HoldReceipt,
    out: Option<OutGuard>,
    /// Sent again from the fallback if dropped now: until it has run to its end (a panic
    /// included: it would panic again), and never once it was sent again.
    hand_off: bool,
}

impl GiveBack {
    async fn run(mut self) {
        use futures_util::FutureExt;
        let release = self
            .limiter
            .release_until_expired(self.account_id, self.hold);
        let _ = std::panic::AssertUnwindSafe(release).catch_unwind().await;
        self.hand_off = false;
    }
}

impl Drop for GiveBack {
    fn drop(&mut self) {
        if !self.hand_off {
            return;
        }
        let Some(out) = self.out.take() else {
            return;
        };
        let Some(fallback) = out.home().cloned() else {
            return; // the guard drops here: the hold's timeout gives the slot back
        };
        let again = GiveBack {
            limiter: self.limiter.clone(),
            account_id: self.account_id,
            hold: self.hold,
            out: Some(out),
            hand_off: false,
        };
        fallback.spawn(again.run());
    }
}

/// A slot refused ([`ConcurrencyLimits::take`]): the answer, and the refusing route's slots per
/// caller when they are known spent (its 429; `None` on a 503: the ledger could not decide).
/// The route is the one that refused: a path on two routes may be refused by the looser one.
#[derive(Debug)]
pub struct SlotRefused {
    pub response: HttpResponse,
    pub in_flight_max: Option<NonZeroU64>,
}

#[derive(Debug, Error)]
pub enum ConcurrencyError {
    #[error("{0:?} {rule}", rule = super::rules::ROUTE_PATTERN_RULE)]
    Route(String),
    #[error("{:?} {}", .0, super::rules::again(.1))]
    Twice(String, String),
    #[error(transparent)]
    Plan(#[from] PlanError),
}

impl ConcurrencyLimits {
    /// `routes`: (pattern, requests in flight per caller), each on its own plan ([`plan_name`])
    /// of the concurrency ledger, sharing `ledger`'s client.
    pub fn new(
        ledger: &Ledger,
        routes: &[(String, NonZeroU64)],
        timeout_seconds: NonZeroU32,
        settings: &LimiterSettings,
    ) -> Result<Self, ConcurrencyError> {
        let slots = ledger.on_ledger(model::LEDGER_CONCURRENCY);
        // No local view: slots end early (voided, by any instance), which a view of this
        // instance's holds cannot see, so only the ledger may refuse a slot.
        let settings = LimiterSettings {
            local_callers_max: 0,
            ..settings.clone()
        };
        let patterns = routes.iter().map(|(pattern, _)| pattern.as_str());
        if let Some((pattern, earlier)) = super::rules::first_twice(patterns) {
            return Err(ConcurrencyError::Twice(
                pattern.to_owned(),
                earlier.to_owned(),
            ));
        }
        let mut limits = Vec::with_capacity(routes.len());
        for (pattern, in_flight_max) in routes {
            if !is_route_pattern(pattern) {
                return Err(ConcurrencyError::Route(pattern.clone()));
            }
            let name = plan_name(pattern);
            let plan = Plan::new(&name, *in_flight_max, timeout_seconds)?;
            let plans = PlanBook::new(vec![plan], &name, [], [], UnknownKeys::DefaultPlan)?;
            // Counted (plan `concurrency-<hash>`), but the request's span keeps the caller's fields.
            let limiter = Limiter::new(slots.clone(), Arc::new(plans), settings.clone())
                .without_span_fields()
                .voiding_late_holds();
            debug_assert_eq!(limiter.local_callers(), 0);
            limits.push((pattern.clone(), Arc::new(limiter)));
        }
        most_specific_first(&mut limits);
        Ok(ConcurrencyLimits {
            routes: limits,
            out: Outstanding::here(),
        })
    }

    /// The slots handed out and not back yet (see [`Outstanding::back`]).
    pub fn slots_out(&self) -> Outstanding {
        self.out.clone()
    }

    /// A slot for `key` if `path` has a concurrency limit; `Err` is the answer when none is free
    /// (429, `Retry-After: 1`: slots come back as requests finish) or the ledger failed closed
    /// (503), by `deadline`. In `shadow` mode a refusal lets the request through without a slot.
    ///
    /// A path whose two forms are on two routes ([`ConcurrencyLimits::for_path`]) takes a slot
    /// on each, both or neither: one on the stricter alone let `/reports%2Fx` in beside three
    /// `/reports/x` under a limit of three on `/reports/*`, as it took a slot of `/rep*`.
    pub async fn take(
        &self,
        path: &str,
        key: &CallerKey,
        shadow: bool,
        deadline: Instant,
    ) -> Result<Option<Slot>, SlotRefused> {
        let (Some(slots), other) = self.routes_for(path) else {
            return Ok(None);
        };
        let taken = self.take_on(slots, key, shadow, deadline).await?;
        let Some(other) = other else {
            return Ok(taken);
        };
        match self.take_on(other, key, shadow, deadline).await {
            Ok(Some(also)) => match taken {
                Some(mut slot) => {
                    slot.also = Some(Box::new(also));
                    Ok(Some(slot))
                }
                None => Ok(Some(also)),
            },
            Ok(None) => Ok(taken),
            Err(refused) => {
                // Given back by the deadline, or from the limits' fallback runtime past it (a
                // dropped release goes on there): a ledger slow or down held the refusal until
                // the slot's timeout, a minute by default, as the release was sent again.
                if let Some(slot) = taken {
                    let _ = tokio::time::timeout_at(deadline.into(), slot.release()).await;
                }
                Err(refused)
            }
        }
    }

    /// [`ConcurrencyLimits::take`] on one route's `slots`.
    async fn take_on(
        &self,
        slots: &Arc<Limiter>,
        key: &CallerKey,
        shadow: bool,
        deadline: Instant,
    ) -> Result<Option<Slot>, SlotRefused> {
        // Boxed: only routes with a concurrency limit carry the decision's state.
        let refused = match Box::pin(Slot::take(slots, key, shadow, deadline)).await {
            Ok(slot) => {
                return Ok(slot.map(|mut slot| {
                    slot.out = Some(self.out.count_out());
                    slot
                }))
            }
            Err(refused) => refused,
        };
        record_refusal(&refused);
        let in_flight_max = slots.plans().capacity_min();
        let (mut response, spent) = match refused {
            Outcome::FailedClosed(error) => {
                let detail = format!(
                    "the rate limiter could not decide in time ({})",
                    error.kind().as_str()
                );
                let response = problem::response(ProblemKind::LedgerUnavailable, &detail);
                (response, None)
            }
            _ => {
                let detail = format!(
                    "at most {in_flight_max} requests of one caller in flight on this route"
                );
                let response = problem::response(ProblemKind::RateLimited, &detail);
                (response, Some(in_flight_max))
            }
        };
        let retry = actix_web::http::header::HeaderValue::from_static("1");
        response
            .headers_mut()
            .insert(actix_web::http::header::RETRY_AFTER, retry);
        Err(SlotRefused {
            response,
            in_flight_max: spent,
        })
    }

    /// Moves every route's per-thread decision counts to their counters (at each scrape).
    pub fn drain_counts(&self) {
        for (_, limiter) in &self.routes {
            limiter.drain_counts();
        }
    }

    /// The limiter of the most specific route pattern that matches `path` (an exact path, else
    /// the longest prefix). Where `path` decoded ([`decoded_path`]: what the handler reads) is
    /// on another route, the one of the two with fewer slots: an escaped `/` in a path parameter
    /// neither dodges a route's slots nor trades them for a looser route's.
    pub fn for_path(&self, path: &str) -> Option<&Arc<Limiter>> {
        self.routes_for(path).0
    }

    /// [`Self::for_path`]'s limiter, and where `path` and its decoded form are on two routes,
    /// the other one: a request takes a slot on both ([`ConcurrencyLimits::take`]).
    fn routes_for(&self, path: &str) -> (Option<&Arc<Limiter>>, Option<&Arc<Limiter>>) {
        let find = |path: &str| {
            (self.routes.iter())
                .find(|(pattern, _)| path_matches(pattern, path))
                .map(|(_, limiter)| limiter)
        };
        let routed = find(path);
        let std::borrow::Cow::Owned(decoded) = decoded_path(path) else {
            return (routed, None);
        };
        match (find(&decoded), routed) {
            (Some(a), Some(b)) if Arc::ptr_eq(a, b) => (Some(a), None),
            // The one with fewer slots first (the decoded form's on a tie).
            (Some(a), Some(b)) if b.plans().capacity_min() < a.plans().capacity_min() => {
                (Some(b), Some(a))
            }
            (Some(a), Some(b)) => (Some(a), Some(b)),
            (a, b) => (a.or(b), None),
        }
    }
}

/// What the request's span says of a route's concurrency refusal: the rate's decision was
/// recorded first (`admitted`), and the slot's limiter records nothing on the span (it would
/// put its own plan where the caller's is).
fn record_refusal(refused: &Outcome) {
    let span = tracing::Span::current();
    if span.is_disabled() {
        return;
    }
    span.record(fields::DECISION, DecisionLabel::of(refused).as_str());
    span.record(fields::LIMIT, CONCURRENCY_LIMIT_NAME);
    if let Outcome::Limited { source, .. } = refused {
        // Slots come back as requests finish.
        crate::telemetry::span::limited_event(1, source.as_str());
    }
}

/// The `ratelimit.limit` of a request refused a concurrency slot (so no route limit may be
/// named so).
pub const CONCURRENCY_LIMIT_NAME: &str = "concurrency";

/// Whether `name` is reserved, for a plan or a route limit: `none` (the `plan` label of keys
/// refused before any plan), `concurrency` (a slot refusal's item and `ratelimit.limit`) and
/// names starting `concurrency-` (the slots' own plans).
pub fn reserved_name(name: &str) -> bool {
    use crate::limiter::metrics::PLAN_NONE;
    name == PLAN_NONE || name == CONCURRENCY_LIMIT_NAME || name.starts_with(CONCURRENCY_PLAN_PREFIX)
}

/// A slot taken; given back by [`Slot::release`], or on drop.
pub struct Slot {
    limiter: Arc<Limiter>,
    account_id: u128,
    hold: Option<HoldReceipt>,
    /// Counted out by its limits until given back (and their fallback runtime with it).
    out: Option<OutGuard>,
    /// The slot of the path's other route, taken with this one and given back with it
    /// ([`ConcurrencyLimits::take`]).
    also: Option<Box<Slot>>,
}

impl Slot {
    /// Takes a slot for `key`: `Ok(Some)` held, `Ok(None)` nothing to hold (the failure policy
    /// admitted without the ledger, or a refusal let through and counted in `shadow` mode),
    /// `Err` the refusing decision's outcome (in flight at the max, or the ledger failed closed
    /// by `deadline`).
    pub async fn take(
        limiter: &Arc<Limiter>,
        key: &CallerKey,
        shadow: bool,
        deadline: Instant,
    ) -> Result<Option<Slot>, Outcome> {
        let decided = limiter.check_by(key, NonZeroU64::MIN, deadline);
        let decision: Decision<'_> = match decided.await {
            Ok(decision) => decision,
            // A concurrency plan takes every key (its book has no rules): never reached.
            Err(_) => return Ok(None),
        };
        match decision.outcome {
            Outcome::Admitted => Ok(Some(Slot {
                limiter: limiter.clone(),
                account_id: decision.account_id,
                hold: decision.hold,
                out: None,
                also: None,
            })),
            Outcome::FailedOpen(_) => Ok(None),
            _ if shadow => {
                limiter.pass_in_shadow(&decision);
                Ok(None)
            }
            refused => Err(refused),
        }
    }

    /// Gives the slot back now, sent again until it lands or expires. Dropped before it ends
    /// (its caller's future was), the give-back of a slot of [`ConcurrencyLimits::take`] goes
    /// on from the limits' fallback runtime, as a dropped slot's does: it was lost while it
    /// waited for a place or to be sent again, the slot held until its timeout. (A slot of
    /// [`Slot::take`] has no such runtime: its hold's timeout gives it back then.)
    pub async fn release(mut self) {
        let also = self.also.take();
        if let Some(give_back) = self.give_back() {
            give_back.run().await;
        }
        if let Some(also) = also {
            Box::pin(also.release()).await;
        }
    }

    /// The give-back of the slot's hold, once (`None` if nothing is held).
    fn give_back(&mut self) -> Option<GiveBack> {
        let hold = self.hold.take()?;
        Some(GiveBack {
            limiter: self.limiter.clone(),
            account_id: self.account_id,
            hold,
            out: self.out.take(),
            hand_off: true,
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        // Given back from a task of its own, on the runtime it is dropped on (the client went
        // away, the body ended, or the handler panicked); without one, or with one shutting
        // down, from its limits' fallback runtime; without that either, the hold's timeout does.
        let Some(give_back) = self.give_back() else {
            return;
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(give_back.run());
        }
    }
}
