//! The request's server span and the limiter's fields on it. The names are declared here once:
//! [`LimiterRootSpan`] creates them empty, the limiter records them (recording a field a span does
//! not declare is a no-op, so both must change together).

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::Error;
use tracing::Span;
use tracing_actix_web::{DefaultRootSpanBuilder, RootSpanBuilder};

/// Span fields the limiter records. `user.id` is the caller's account id, never the raw key.
pub mod fields {
    pub const USER_ID: &str = "user.id";
    pub const KEY_ID: &str = "ratelimit.key_id";
    pub const PLAN: &str = "ratelimit.plan";
    pub const COST: &str = "ratelimit.cost";
    pub const DECISION: &str = "ratelimit.decision";
    /// `ledger`, `local_view` (refused from memory: no ledger call) or `none`.
    pub const SOURCE: &str = "ratelimit.source";
    pub const REMAINING: &str = "ratelimit.remaining";
    /// `true` when a refusal was let through because the route is in shadow mode.
    pub const SHADOW: &str = "ratelimit.shadow";
    /// The route limit that refused the request (a route charged against several limits).
    pub const LIMIT: &str = "ratelimit.limit";
}

/// The server span of every request, with the limiter's fields declared (empty until recorded).
pub struct LimiterRootSpan;

impl RootSpanBuilder for LimiterRootSpan {
    fn on_request_start(request: &ServiceRequest) -> Span {
        tracing_actix_web::root_span!(
            request,
            user.id = tracing::field::Empty,
            ratelimit.key_id = tracing::field::Empty,
            ratelimit.plan = tracing::field::Empty,
            ratelimit.cost = tracing::field::Empty,
            ratelimit.decision = tracing::field::Empty,
            ratelimit.source = tracing::field::Empty,
            ratelimit.remaining = tracing::field::Empty,
            ratelimit.shadow = tracing::field::Empty,
            ratelimit.limit = tracing::field::Empty,
        )
    }

    fn on_request_end<B: MessageBody>(span: Span, outcome: &Result<ServiceResponse<B>, Error>) {
        DefaultRootSpanBuilder::on_request_end(span, outcome);
    }
}
