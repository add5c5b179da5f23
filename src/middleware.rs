//! The actix-web middleware: every request through a wrapped scope is identified, checked against
//! the ledger, and either passed on with the rate-limit fields or answered 429 / 4xx / 503.
//!
//! ```no_run
//! use std::sync::Arc;
//! use actix_web::{web, App, HttpServer};
//! use ledger_limiter::middleware::{RateLimit, RateLimitPolicy};
//! use ledger_limiter::limiter::Limiter;
//!
//! # async fn run(limiter: Arc<Limiter>) -> std::io::Result<()> {
//! let policy = Arc::new(RateLimitPolicy::default());
//! HttpServer::new(move || {
//!     App::new()
//!         .wrap(RateLimit::new(limiter.clone(), policy.clone()))
//!         .route("/greeting", web::get().to(|| async { "hello" }))
//! })
//! .bind(("127.0.0.1", 8080))?
//! .run()
//! .await
//! # }
//! ```

use std::collections::HashMap;
use std::future::{ready, Ready};
use std::num::NonZeroU64;
use std::rc::Rc;
use std::sync::Arc;

use actix_web::body::EitherBody;
use actix_web::dev::{forward_ready, Service, ServiceRequest, ServiceResponse, Transform};
use actix_web::http::header::{HeaderMap, HeaderName};
use actix_web::Error;
use futures_util::future::LocalBoxFuture;

use crate::caller::{CallerKey, KeyError, KeySource, KEY_LENGTH_MAX_DEFAULT};
use crate::headers::{self, PolicyFields};
use crate::limiter::{Limiter, Outcome};
use crate::metrics::{DecisionLabel, DecisionSource};
use crate::problem::{self, ProblemKind};

/// How requests map to callers and costs, and which paths are not limited.
#[derive(Debug, Clone)]
pub struct RateLimitPolicy {
    pub key_source: KeySource,
    pub key_length_max: usize,
    /// Exact paths, or prefixes ending in `*`, that bypass the limiter.
    pub exempt_paths: Vec<String>,
    pub route_costs: RouteCosts,
}

impl Default for RateLimitPolicy {
    fn default() -> Self {
        RateLimitPolicy {
            key_source: KeySource::Header(HeaderName::from_static("x-api-key")),
            key_length_max: KEY_LENGTH_MAX_DEFAULT,
            exempt_paths: vec![],
            route_costs: RouteCosts::default(),
        }
    }
}

fn path_matches(pattern: &str, path: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => path.starts_with(prefix),
        None => pattern == path,
    }
}

/// The cost of a request by path: exact paths first, then the longest matching `prefix*`, then 1.
#[derive(Debug, Clone, Default)]
pub struct RouteCosts {
    exact: HashMap<String, NonZeroU64>,
    prefixes: Vec<(String, NonZeroU64)>,
}

impl RouteCosts {
    pub fn new(costs: impl IntoIterator<Item = (String, NonZeroU64)>) -> Self {
        let mut exact = HashMap::new();
        let mut prefixes = Vec::new();
        for (pattern, cost) in costs {
            match pattern.strip_suffix('*') {
                Some(prefix) => prefixes.push((prefix.to_owned(), cost)),
                None => {
                    exact.insert(pattern, cost);
                }
            }
        }
        prefixes.sort_by_key(|(prefix, _)| std::cmp::Reverse(prefix.len()));
        RouteCosts { exact, prefixes }
    }

    pub fn cost(&self, path: &str) -> NonZeroU64 {
        if let Some(cost) = self.exact.get(path) {
            return *cost;
        }
        self.prefixes
            .iter()
            .find(|(prefix, _)| path.starts_with(prefix.as_str()))
            .map(|(_, cost)| *cost)
            .unwrap_or(NonZeroU64::MIN)
    }

    pub fn max(&self) -> NonZeroU64 {
        self.exact
            .values()
            .chain(self.prefixes.iter().map(|(_, c)| c))
            .copied()
            .max()
            .unwrap_or(NonZeroU64::MIN)
    }
}

impl RateLimitPolicy {
    fn is_exempt(&self, path: &str) -> bool {
        self.exempt_paths.iter().any(|p| path_matches(p, path))
    }

    /// Identifies the caller, before any ledger call.
    pub fn caller_key(&self, req: &ServiceRequest) -> Result<CallerKey, KeyError> {
        match &self.key_source {
            KeySource::Header(name) => {
                let mut values = req.headers().get_all(name);
                let header = name.as_str();
                let value = values.next().ok_or_else(|| KeyError::Missing {
                    header: header.to_owned(),
                })?;
                if values.next().is_some() {
                    return Err(KeyError::Repeated {
                        header: header.to_owned(),
                    });
                }
                CallerKey::from_header_value(header, value.as_bytes(), self.key_length_max)
            }
            KeySource::PeerIp => req
                .peer_addr()
                .map(|a| CallerKey::from_ip(a.ip()))
                .ok_or(KeyError::NoPeerAddress),
        }
    }
}

/// The middleware factory: `.wrap(RateLimit::new(limiter, policy))`.
#[derive(Clone)]
pub struct RateLimit {
    limiter: Arc<Limiter>,
    policy: Arc<RateLimitPolicy>,
    policy_fields: Arc<PolicyFields>,
}

impl RateLimit {
    pub fn new(limiter: Arc<Limiter>, policy: Arc<RateLimitPolicy>) -> Self {
        let policy_fields = Arc::new(PolicyFields::new(limiter.plans()));
        RateLimit {
            limiter,
            policy,
            policy_fields,
        }
    }
}

impl<S, B> Transform<S, ServiceRequest> for RateLimit
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: 'static,
{
    type Response = ServiceResponse<EitherBody<B>>;
    type Error = Error;
    type Transform = RateLimitMiddleware<S>;
    type InitError = ();
    type Future = Ready<Result<Self::Transform, Self::InitError>>;

    fn new_transform(&self, service: S) -> Self::Future {
        ready(Ok(RateLimitMiddleware {
            service: Rc::new(service),
            limiter: self.limiter.clone(),
            policy: self.policy.clone(),
            policy_fields: self.policy_fields.clone(),
        }))
    }
}

pub struct RateLimitMiddleware<S> {
    service: Rc<S>,
    limiter: Arc<Limiter>,
    policy: Arc<RateLimitPolicy>,
    policy_fields: Arc<PolicyFields>,
}

fn key_problem(error: &KeyError) -> ProblemKind {
    match error {
        KeyError::Missing { .. } | KeyError::NoPeerAddress => ProblemKind::MissingKey,
        KeyError::Unknown => ProblemKind::UnknownKey,
        KeyError::Empty { .. }
        | KeyError::TooLong { .. }
        | KeyError::Malformed { .. }
        | KeyError::Repeated { .. } => ProblemKind::InvalidKey,
    }
}

/// Span fields the limiter records on the request's server span (declared by
/// [`crate::telemetry::LimiterRootSpan`]; recording on a span without them is a no-op).
pub mod span_fields {
    pub const USER_ID: &str = "user.id";
    pub const KEY_ID: &str = "ratelimit.key_id";
    pub const PLAN: &str = "ratelimit.plan";
    pub const COST: &str = "ratelimit.cost";
    pub const DECISION: &str = "ratelimit.decision";
    pub const REMAINING: &str = "ratelimit.remaining";
}

impl<S, B> Service<ServiceRequest> for RateLimitMiddleware<S>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: 'static,
{
    type Response = ServiceResponse<EitherBody<B>>;
    type Error = Error;
    type Future = LocalBoxFuture<'static, Result<Self::Response, Self::Error>>;

    forward_ready!(service);

    fn call(&self, req: ServiceRequest) -> Self::Future {
        let service = self.service.clone();
        let limiter = self.limiter.clone();
        let policy = self.policy.clone();
        let policy_fields = self.policy_fields.clone();
        Box::pin(async move {
            if policy.is_exempt(req.path()) {
                return service.call(req).await.map(|r| r.map_into_left_body());
            }
            let span = tracing::Span::current();
            let plans = limiter.plans();
            let identified = policy.caller_key(&req).and_then(|key| {
                let plan = match policy.key_source {
                    KeySource::PeerIp => Some(plans.default_plan()),
                    KeySource::Header(_) => plans.plan_for_key(key.expose_secret()),
                };
                plan.map(|plan| (key, plan)).ok_or(KeyError::Unknown)
            });
            let (key, plan_id) = match identified {
                Ok(found) => found,
                Err(error) => {
                    limiter.decision_metrics().record(
                        DecisionLabel::RejectedKey,
                        None,
                        DecisionSource::None,
                    );
                    span.record(span_fields::DECISION, DecisionLabel::RejectedKey.as_str());
                    let response = problem::response(key_problem(&error), &error.to_string());
                    return Ok(req.into_response(response).map_into_right_body());
                }
            };
            let cost = policy.route_costs.cost(req.path());
            let decision = limiter.check(&key, plan_id, cost).await;
            let plan = plans.get(plan_id).name();

            let label = match &decision.outcome {
                Outcome::Admitted => DecisionLabel::Admitted,
                Outcome::Limited { .. } => DecisionLabel::Limited,
                Outcome::FailedOpen(_) => DecisionLabel::FailedOpen,
                Outcome::FailedClosed(_) => DecisionLabel::FailedClosed,
            };
            let source = match &decision.outcome {
                Outcome::Admitted => DecisionSource::Ledger,
                Outcome::Limited { source, .. } => *source,
                Outcome::FailedOpen(_) | Outcome::FailedClosed(_) => DecisionSource::None,
            };
            limiter
                .decision_metrics()
                .record(label, Some(plan_id), source);
            // Only when traced: the key id costs a hash.
            if !span.is_disabled() {
                span.record(
                    span_fields::USER_ID,
                    tracing::field::display(format_args!("{:032x}", decision.account_id)),
                );
                span.record(span_fields::KEY_ID, tracing::field::display(key.key_id()));
                span.record(span_fields::PLAN, plan);
                span.record(span_fields::COST, cost.get());
                span.record(span_fields::DECISION, label.as_str());
                span.record(span_fields::REMAINING, decision.quota.remaining);
            }

            let add_fields = |headers: &mut HeaderMap, retry_after_seconds: Option<u64>| {
                let policy = policy_fields.get(plan_id);
                headers::insert(headers, plan, policy, &decision.quota, retry_after_seconds);
            };
            match decision.outcome {
                Outcome::Admitted | Outcome::FailedOpen(_) => {
                    let mut response = service.call(req).await?;
                    add_fields(response.headers_mut(), None);
                    Ok(response.map_into_left_body())
                }
                Outcome::Limited {
                    retry_after_seconds,
                    source,
                } => {
                    // A span event for traces, not a log line: 429s can come by the thousand.
                    tracing::info!(
                        target: crate::telemetry::SPAN_EVENTS_TARGET,
                        retry_after_seconds,
                        source = source.as_str(),
                        "limited"
                    );
                    let detail = format!(
                        "plan {plan} allows {} units per {} s; retry after {retry_after_seconds} s",
                        decision.quota.limit, decision.quota.window_seconds
                    );
                    let mut response = problem::response(ProblemKind::RateLimited, &detail);
                    add_fields(response.headers_mut(), Some(retry_after_seconds));
                    Ok(req.into_response(response).map_into_right_body())
                }
                Outcome::FailedClosed(error) => {
                    let detail = format!(
                        "the rate limiter could not decide in time ({})",
                        error.kind().as_str()
                    );
                    let mut response = problem::response(ProblemKind::LedgerUnavailable, &detail);
                    // Worth retrying soon: the ledger, not the caller's credit, is the problem.
                    add_fields(response.headers_mut(), Some(1));
                    Ok(req.into_response(response).map_into_right_body())
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::test::TestRequest;

    fn policy() -> RateLimitPolicy {
        RateLimitPolicy {
            exempt_paths: vec!["/healthz".into(), "/metrics*".into()],
            route_costs: RouteCosts::new([
                ("/expensive".to_owned(), NonZeroU64::new(5).unwrap()),
                ("/batch/*".to_owned(), NonZeroU64::new(3).unwrap()),
            ]),
            ..RateLimitPolicy::default()
        }
    }

    #[test]
    fn exempt_paths_and_costs() {
        let p = policy();
        assert!(p.is_exempt("/healthz"));
        assert!(p.is_exempt("/metrics/exemplars"));
        assert!(!p.is_exempt("/healthz/x"));
        assert_eq!(p.route_costs.cost("/expensive").get(), 5);
        assert_eq!(p.route_costs.cost("/batch/7").get(), 3);
        assert_eq!(p.route_costs.cost("/greeting").get(), 1);
        assert_eq!(p.route_costs.max().get(), 5);
    }

    #[test]
    fn caller_key_from_headers() {
        let p = policy();
        let req = TestRequest::default().to_srv_request();
        assert!(matches!(p.caller_key(&req), Err(KeyError::Missing { .. })));
        let req = TestRequest::default()
            .insert_header(("X-Api-Key", "abc"))
            .to_srv_request();
        assert_eq!(p.caller_key(&req).unwrap().expose_secret(), "abc");
        let req = TestRequest::default()
            .append_header(("X-Api-Key", "a"))
            .append_header(("X-Api-Key", "b"))
            .to_srv_request();
        assert!(matches!(p.caller_key(&req), Err(KeyError::Repeated { .. })));
        let long = "k".repeat(KEY_LENGTH_MAX_DEFAULT + 1);
        let req = TestRequest::default()
            .insert_header(("X-Api-Key", long))
            .to_srv_request();
        assert_eq!(
            key_problem(&p.caller_key(&req).unwrap_err()),
            ProblemKind::InvalidKey
        );
    }

    #[test]
    fn caller_key_from_peer() {
        let p = RateLimitPolicy {
            key_source: KeySource::PeerIp,
            ..policy()
        };
        let req = TestRequest::default()
            .peer_addr("10.1.2.3:4000".parse().unwrap())
            .to_srv_request();
        assert_eq!(p.caller_key(&req).unwrap().expose_secret(), "ip:10.1.2.3");
    }
}
