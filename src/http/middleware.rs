//! The actix-web middleware: every request through a wrapped scope is classified (exempt, rejected
//! key, or a charge), decided by the [`Limiter`], and either passed on with the rate-limit fields
//! or answered 429 / 4xx / 503.
//!
//! ```no_run
//! use std::sync::Arc;
//! use actix_web::{web, App, HttpServer};
//! use ledger_limiter::http::{RateLimit, RequestRules};
//! use ledger_limiter::limiter::Limiter;
//!
//! # async fn run(limiter: Arc<Limiter>) -> anyhow::Result<()> {
//! let rules = Arc::new(RequestRules::builder().cost("/reports", 5).build(limiter.plans())?);
//! // Made outside the workers: lease renewals run on the runtime it is made on.
//! let rate_limit = RateLimit::new(limiter.clone(), rules);
//! let renewals = rate_limit.renewals();
//! HttpServer::new(move || {
//!     App::new()
//!         .wrap(rate_limit.clone())
//!         .route("/greeting", web::get().to(|| async { "hello" }))
//! })
//! .bind(("127.0.0.1", 8080))?
//! .run()
//! .await?;
//! // Renewals still running end, then leased units go back (lease plans).
//! renewals.back(std::time::Duration::from_secs(2)).await;
//! limiter.settle_all_leases().await;
//! # Ok(())
//! # }
//! ```

use std::future::{ready, Future, Ready};
use std::num::NonZeroU64;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use actix_web::body::EitherBody;
use actix_web::dev::{forward_ready, Service, ServiceRequest, ServiceResponse, Transform};
use actix_web::http::header::HeaderName;
use actix_web::{Error, HttpResponse};
use futures_util::future::{Either, LocalBoxFuture};

use super::concurrency::{ConcurrencyLimits, Slot, SlotRefused};
use super::headers::PolicyHeaders;
use super::respond::{self, Fields};
use super::rules::{Classified, RequestRules};
use super::slot_body::SlotBody;
use crate::limiter::caller::CallerKey;
use crate::limiter::plan::{Plan, PlanId};
use crate::limiter::{Decision, FromMemory, Limiter, Outcome, Quota, RenewalAhead};
use crate::outstanding::Outstanding;

/// One worker's middleware state. Each worker has its own copy (in an `Rc`), so that a request
/// touches no reference count or header bytes that the other workers write too: with both
/// cores on the same callers, those shared cache lines cost more than the decision itself.
struct Inner {
    limiter: Arc<Limiter>,
    rules: Arc<RequestRules>,
    fields: Fields,
    concurrency: Arc<ConcurrencyLimits>,
    renewals: Outstanding,
}

/// The middleware factory: `.wrap(RateLimit::new(limiter, rules))`. Each worker makes its own
/// state from it (`Inner::for_worker`).
#[derive(Clone)]
pub struct RateLimit {
    limiter: Arc<Limiter>,
    rules: Arc<RequestRules>,
    concurrency: Arc<ConcurrencyLimits>,
    /// Lease renewals ahead of need, run on the runtime this was made on
    /// ([`Inner::renew_ahead`]).
    renewals: Outstanding,
}

impl RateLimit {
    /// Make it on the runtime that outlives the server's workers (the main one, outside
    /// `HttpServer::new`'s closure, which runs on each worker's): lease renewals ahead of need
    /// run on the runtime it is made on, and one made in the closure runs them on a worker's,
    /// which a stop ends, dropping them ([`RateLimit::renewals`]).
    pub fn new(limiter: Arc<Limiter>, rules: Arc<RequestRules>) -> Self {
        RateLimit {
            limiter,
            rules,
            concurrency: Arc::new(ConcurrencyLimits::default()),
            renewals: Outstanding::here(),
        }
    }

    /// The lease renewals ahead of need still running: a stop waits for them
    /// ([`Outstanding::back`]) before it settles every lease, so that none of them takes a
    /// lease after that settling, unknown to any instance then, its units held window + L. (A
    /// renewal a request runs itself ends with the request, within the stop's drain unless
    /// `ledger.timeout_ms` is longer.)
    pub fn renewals(&self) -> Outstanding {
        self.renewals.clone()
    }

    /// Adds concurrency limits: after the rate limit admits a request, it also takes a slot
    /// (see [`ConcurrencyLimits`]); a request refused for want of a slot is not charged.
    pub fn with_concurrency(self, limits: ConcurrencyLimits) -> Self {
        RateLimit {
            concurrency: Arc::new(limits),
            ..self
        }
    }

    /// Moves the per-thread decision counts of the limiter and of every concurrency limit to
    /// their counters: call it before rendering a scrape, so it sees every decision made.
    pub fn drain_counts(&self) {
        self.limiter.drain_counts();
        self.concurrency.drain_counts();
    }
}

impl<S, B> Transform<S, ServiceRequest> for RateLimit
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: 'static,
{
    type Response = ServiceResponse<EitherBody<SlotBody<B>>>;
    type Error = Error;
    type Transform = RateLimitMiddleware<S>;
    type InitError = ();
    type Future = Ready<Result<Self::Transform, Self::InitError>>;

    fn new_transform(&self, service: S) -> Self::Future {
        ready(Ok(RateLimitMiddleware {
            service: Rc::new(service),
            inner: Rc::new(Inner::for_worker(self)),
        }))
    }
}

pub struct RateLimitMiddleware<S> {
    service: Rc<S>,
    inner: Rc<Inner>,
}

impl<S, B> Service<ServiceRequest> for RateLimitMiddleware<S>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: 'static,
{
    type Response = ServiceResponse<EitherBody<SlotBody<B>>>;
    type Error = Error;
    /// Ready for the answers made at once, the handler's own future for an exempt request or
    /// one admitted from its caller's lease, boxed for the rest.
    type Future = Either<
        Ready<Result<Self::Response, Self::Error>>,
        Either<Served<S::Future>, LocalBoxFuture<'static, Result<Self::Response, Self::Error>>>,
    >;

    forward_ready!(service);

    /// Classify → decide → respond. A rejected key, a refusal from memory and an admission from a
    /// lease are decided here; everything else is decided in the request's future.
    fn call(&self, req: ServiceRequest) -> Self::Future {
        let charge = match self.inner.rules.classify(&req) {
            Classified::Exempt => {
                let response = self.service.call(req);
                // Nothing to settle, but the cost header never reaches the client.
                let strip = self.inner.rules.cost_header().cloned();
                let fields = None;
                return Either::Right(Either::Left(Served {
                    response,
                    fields,
                    strip,
                }));
            }
            Classified::Rejected(error) => {
                self.inner.limiter.reject_key();
                let rules = &self.inner.rules;
                let response =
                    respond::rejected(&error, rules.missing_key_status(), rules.challenge());
                return Either::Left(ready(Ok(req.into_response(response).map_into_right_body())));
            }
            Classified::Charge {
                key,
                cost,
                shadow,
                refund,
                limits,
            } => {
                // Shadow mode and further limits take the long way: they are rare, and both
                // change what a refusal means.
                if !shadow && limits.is_none() {
                    let may_lease = !refund && self.inner.serves_plainly(req.match_info().as_str());
                    match self.inner.limiter.from_memory(&key, cost, may_lease) {
                        Some(FromMemory::Refused(decision)) => {
                            let response = req.into_response(self.inner.refusal(&decision));
                            return Either::Left(ready(Ok(response.map_into_right_body())));
                        }
                        Some(FromMemory::Leased(decision, renewal)) => {
                            let response = self.service.call(req);
                            let leased = self.inner.leased(&decision, renewal, response);
                            return Either::Right(Either::Left(leased));
                        }
                        None => {}
                    }
                }
                Charge {
                    key,
                    cost,
                    shadow,
                    refund,
                    limits,
                }
            }
        };
        let service = self.service.clone();
        let decided = decide_and_serve(service, self.inner.clone(), req, charge);
        Either::Right(Either::Right(Box::pin(decided)))
    }
}

/// What the request is charged, from [`Classified::Charge`].
struct Charge {
    key: CallerKey,
    cost: NonZeroU64,
    shadow: bool,
    refund: bool,
    limits: Option<Arc<[Plan]>>,
}

/// Decide on the ledger (or a lease) → refuse, or serve with a concurrency slot and settle.
async fn decide_and_serve<S, B>(
    service: Rc<S>,
    inner: Rc<Inner>,
    req: ServiceRequest,
    charge: Charge,
) -> Result<ServiceResponse<EitherBody<SlotBody<B>>>, Error>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: 'static,
{
    let Charge {
        key,
        cost,
        shadow,
        refund,
        limits,
    } = charge;
    let limits = limits.as_deref().unwrap_or_default();
    // One deadline for the request's decisions, the rate's and the slot's: its answer comes
    // within one `ledger.timeout_ms`, however slow the ledger.
    let deadline = inner.limiter.deadline();
    let decided = inner.limiter.check_with_by(&key, cost, limits, deadline);
    let mut decision = match decided.await {
        Ok((decision, renewal)) => {
            inner.renew_ahead(renewal);
            decision
        }
        Err(error) => {
            let rules = &inner.rules;
            let response = respond::rejected(&error, rules.missing_key_status(), rules.challenge());
            return Ok(req.into_response(response).map_into_right_body());
        }
    };
    // Shadow mode tries limits out; an operator's block is meant at once. Let through before
    // any refusal is built: building one records the `limited` event, said to be on 429s.
    let blocked = matches!(decision.outcome, Outcome::Blocked { .. });
    if decision.outcome.refuses() && shadow && !blocked {
        inner.limiter.pass_in_shadow(&decision);
    } else if let Some(response) = respond::refusal(&decision, &inner.fields) {
        return Ok(req.into_response(response).map_into_right_body());
    }
    let unserved = GiveBackIfDropped::new(&inner.limiter, &mut decision);
    let taken = inner
        .concurrency
        .take(req.match_info().as_str(), &key, shadow, deadline)
        .await;
    unserved.disarm();
    let slot = match taken {
        Ok(slot) => slot,
        Err(refused) => {
            let response = inner.slot_refused(&mut decision, refused);
            return Ok(req.into_response(response).map_into_right_body());
        }
    };
    serve_and_settle(service, &inner, req, &mut decision, (refund, slot)).await
}

/// Serves an admitted request and settles what it holds (a refund of a server error, or of a
/// panic, on a refund route; a reported cost), then adds its fields. Its slot rides on the body.
async fn serve_and_settle<S, B>(
    service: Rc<S>,
    inner: &Inner,
    req: ServiceRequest,
    decision: &mut Decision<'_>,
    (refund, slot): (bool, Option<Slot>),
) -> Result<ServiceResponse<EitherBody<SlotBody<B>>>, Error>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: 'static,
{
    let refund_if_panicking = GiveBackIfDropped::if_panicking(&inner.limiter, decision, refund);
    let served = service.call(req).await;
    refund_if_panicking.disarm();
    let mut response = match served {
        Ok(response) => response,
        Err(error) => {
            // Its response is made past this middleware, without the fields (a request cloned
            // to make it here breaks actix's routing).
            inner.settle_error(decision, &error, refund).await;
            return Err(error);
        }
    };
    inner.settle(decision, &mut response, refund).await;
    respond::add_fields(response.headers_mut(), &inner.fields, decision, None);
    // The slot is given back when the body is sent (or the client goes away).
    let response = response.map_body(|_, body| SlotBody::new(body, slot));
    Ok(response.map_into_left_body())
}

/// Gives an admitted request's holds back when dropped, unless disarmed first: a request whose
/// client goes away while its concurrency slot is decided is never served, and was left charged
/// for the window (a slot refused gives them back; the slot's own late hold is voided).
struct GiveBackIfDropped<'d, 'a> {
    limiter: &'d Arc<Limiter>,
    decision: Option<&'d mut Decision<'a>>,
    /// Only when dropped by a panic's unwinding (tokio drops a panicking task's future there).
    panicking_only: bool,
}

impl<'d, 'a> GiveBackIfDropped<'d, 'a> {
    fn new(limiter: &'d Arc<Limiter>, decision: &'d mut Decision<'a>) -> Self {
        GiveBackIfDropped {
            limiter,
            decision: Some(decision),
            panicking_only: false,
        }
    }

    /// Gives back only if the handler panics, and only when `armed` (a refund route): its
    /// promise is that our failures are not charged, and a panic is one (a client gone
    /// mid-request is not: it was served).
    fn if_panicking(
        limiter: &'d Arc<Limiter>,
        decision: &'d mut Decision<'a>,
        armed: bool,
    ) -> Self {
        GiveBackIfDropped {
            limiter,
            decision: armed.then_some(decision),
            panicking_only: true,
        }
    }

    /// The request goes on: its holds are its own to settle.
    fn disarm(mut self) {
        self.decision = None;
    }
}

impl Drop for GiveBackIfDropped<'_, '_> {
    fn drop(&mut self) {
        if self.panicking_only && !std::thread::panicking() {
            return;
        }
        if let Some(decision) = self.decision.take() {
            give_back_unserved(self.limiter, decision);
        }
    }
}

/// Gives back what an admitted request that is not served holds (a slot refused it, or it was
/// dropped before its slot): a leased unit to its lease here and now, holds by voids from a task
/// of their own, after the answer (without a runtime, their window ends them).
fn give_back_unserved(limiter: &Arc<Limiter>, decision: &mut Decision<'_>) {
    let Some(holds) = limiter.give_back_later(decision) else {
        return;
    };
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        let limiter = limiter.clone();
        runtime.spawn(async move { limiter.void_holds(holds).await });
    }
}

pin_project_lite::pin_project! {
    /// A request served without a future of the middleware's own: the handler's future, then
    /// the body wrapped for the middleware's response type and, for a request admitted from its
    /// caller's lease in `call`, the rate-limit fields (what [`decide_and_serve`] does for an
    /// admission, when the route has no refund, reported cost or concurrency limit). An exempt
    /// request has no fields.
    pub struct Served<F> {
        #[pin]
        response: F,
        fields: Option<PlanFields>,
        // The cost header, removed from an exempt response (an admission from a lease has
        // none: `Inner::serves_plainly`).
        strip: Option<HeaderName>,
    }
}

/// The rate-limit fields of an admission from a lease: the plan and the quota after it.
struct PlanFields {
    inner: Rc<Inner>,
    plan_id: PlanId,
    quota: Quota,
}

impl<F, B> Future for Served<F>
where
    F: Future<Output = Result<ServiceResponse<B>, Error>>,
{
    type Output = Result<ServiceResponse<EitherBody<SlotBody<B>>>, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let mut response = ready!(this.response.poll(cx))?;
        if let Some(header) = this.strip {
            response.headers_mut().remove(&*header);
        }
        if let Some(PlanFields {
            inner,
            plan_id,
            quota,
        }) = this.fields
        {
            let plan = inner.limiter.plans().get(*plan_id);
            let plan = plan.expect("a decision's plan is in the limiter's book");
            let headers = response.headers_mut();
            respond::add_plan_fields(headers, &inner.fields, (*plan_id, plan), quota, None);
        }
        let response = response.map_body(|_, body| SlotBody::plain(body));
        Poll::Ready(Ok(response.map_into_left_body()))
    }
}

impl Inner {
    /// Whether an admitted request needs nothing after its handler but the rate-limit fields:
    /// no reported cost to settle and no concurrency slot on `path` (refund routes are the
    /// caller's to check).
    fn serves_plainly(&self, path: &str) -> bool {
        self.rules.cost_header().is_none() && self.concurrency.for_path(path).is_none()
    }

    /// The response future of a caller admitted from its lease without waiting
    /// ([`Limiter::from_memory`]): the handler's `response`, then the fields (the renewal the
    /// admission made due runs apart, [`Inner::renew_ahead`]).
    fn leased<F>(
        self: &Rc<Self>,
        decision: &Decision<'_>,
        renewal: Option<RenewalAhead>,
        response: F,
    ) -> Served<F> {
        debug_assert!(decision.outcome == Outcome::Admitted && decision.route_limits.is_empty());
        self.renew_ahead(renewal);
        Served {
            response,
            fields: Some(PlanFields {
                inner: self.clone(),
                plan_id: decision.plan_id,
                quota: decision.quota,
            }),
            strip: None,
        }
    }

    /// Runs the renewal ahead of need an admission made due, if any, as a task apart: the
    /// request is answered without waiting for the ledger. On the runtime the middleware was
    /// made on, when it was made on one: a task of this worker was dropped unfinished when a
    /// stop ended the worker, and a lease it had sent was taken at the ledger with no instance
    /// to settle it (held window + L). Counted until it ends, for the stop to wait for.
    fn renew_ahead(&self, renewal: Option<RenewalAhead>) {
        let Some(renewal) = renewal else {
            return;
        };
        let limiter = self.limiter.clone();
        let running = self.renewals.count_out();
        let home = running.home().cloned();
        let renew = async move {
            limiter.renew_lease_ahead(renewal).await;
            drop(running);
        };
        match home {
            Some(home) => drop(home.spawn(renew)),
            None => drop(actix_web::rt::spawn(renew)),
        }
    }

    /// The 429 (or 403) for a caller that memory alone refuses ([`Limiter::from_memory`]).
    fn refusal(&self, decision: &Decision<'_>) -> HttpResponse {
        respond::refusal(decision, &self.fields).expect("a refusal from memory refuses")
    }

    /// One worker's state; its `RateLimit-Policy` values are made here, so their bytes are its own.
    fn for_worker(factory: &RateLimit) -> Self {
        Inner {
            limiter: factory.limiter.clone(),
            rules: factory.rules.clone(),
            fields: Fields {
                policies: PolicyHeaders::new(factory.limiter.plans()),
                styles: factory.rules.header_styles(),
            },
            concurrency: factory.concurrency.clone(),
            renewals: factory.renewals.clone(),
        }
    }

    /// A request refused a concurrency slot: not served, so not charged (and no refund of a
    /// server error: not counted as one), after the answer (the deadline may be spent). The
    /// rate-limit fields as on any refusal: what the caller has left of its rate (given back),
    /// beside the concurrency's Retry-After.
    fn slot_refused(&self, decision: &mut Decision<'_>, refused: SlotRefused) -> HttpResponse {
        let SlotRefused {
            mut response,
            in_flight_max,
        } = refused;
        give_back_unserved(&self.limiter, decision);
        respond::add_fields(response.headers_mut(), &self.fields, decision, Some(1));
        // The refusing route's slots (a path on two routes may be refused by the looser one);
        // none on a 503 (the slot's ledger could not decide): its slots are not known spent.
        if let Some(slots) = in_flight_max {
            respond::add_slot_refusal(response.headers_mut(), &self.fields, slots.get());
        }
        response
    }

    /// A service inside this one failed (a library user's middleware; actix turns a handler's
    /// errors into responses itself): a refund route's 5xx is refunded as a handler's is.
    async fn settle_error(&self, decision: &mut Decision<'_>, error: &Error, refund: bool) {
        let status = error.as_response_error().status_code();
        if refund && status.is_server_error() {
            self.refund(decision).await;
        }
    }

    /// Gives an admitted request's credit back (a server error on a refund route).
    async fn refund(&self, decision: &mut Decision<'_>) {
        // The ledger's futures are boxed here and in `settle`: inline, they would make every
        // request's middleware future kilobytes larger, and it is moved on each request.
        if let Err(error) = Box::pin(self.limiter.refund(decision)).await {
            tracing::debug!(%error, "could not refund; the hold expires with its window");
        }
    }

    /// After the handler: a refund for a server error on a refund route, else the actual cost
    /// when the handler reported one (in the configured cost header, removed here).
    async fn settle<B>(
        &self,
        decision: &mut Decision<'_>,
        response: &mut ServiceResponse<B>,
        refund: bool,
    ) {
        // The cost header is between the handler and us: it never reaches the client, whatever
        // happens next (a refund included).
        let reported: Option<Vec<_>> = self
            .rules
            .cost_header()
            .map(|header| response.headers_mut().remove(header).collect());
        if refund && response.status().is_server_error() {
            self.refund(decision).await;
            return;
        }
        let Some(values) = reported.filter(|values| !values.is_empty()) else {
            return;
        };
        // Two costs (a handler's and an inner middleware's, say) are neither's to pick.
        let reported_once = match values.as_slice() {
            [value] => respond::reported_cost(value),
            _ => None,
        };
        let Some(actual) = reported_once else {
            tracing::warn!(target: crate::telemetry::SPAN_EVENTS_TARGET, "the handler reported a cost that is not one number up to 2^40; the estimate stands");
            return;
        };
        match Box::pin(self.limiter.recharge(decision, actual)).await {
            Ok(done) if done.contains(&true) => {
                tracing::Span::current().record(crate::telemetry::span::fields::COST, actual);
            }
            Ok(_) => {}
            Err(error) => {
                tracing::debug!(%error, "could not recharge; the estimate stands");
            }
        }
    }
}
