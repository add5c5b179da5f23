//! The request's server span and the limiter's fields on it. The names are declared here once:
//! [`LimiterRootSpan`] creates them empty, the limiter records them (recording a field a span does
//! not declare is a no-op, so both must change together).

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::Method;
use actix_web::Error;
use opentelemetry::trace::TraceContextExt;
use tracing::Span;
use tracing_actix_web::{DefaultRootSpanBuilder, RootSpanBuilder};
use tracing_opentelemetry::OpenTelemetrySpanExt;

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

/// The method label of a method outside the standard ones (as OpenTelemetry names it).
const METHOD_OTHER: &str = "_OTHER";

/// The span event of a request refused for want of credit or of a concurrency slot: an event
/// on the request's trace, not a log line (429s can come by the thousand).
pub fn limited_event(retry_after_seconds: u64, source: &'static str) {
    tracing::info!(
        target: super::SPAN_EVENTS_TARGET,
        retry_after_seconds,
        source,
        "limited"
    );
}

/// Bounded method label: the standard methods, everything else `_OTHER`, for metric
/// labels and span names alike (a client may send any token as its method).
pub fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        Method::PATCH => "PATCH",
        Method::CONNECT => "CONNECT",
        Method::TRACE => "TRACE",
        _ => METHOD_OTHER,
    }
}

/// The server span of every request, with the limiter's fields declared (empty until recorded).
pub struct LimiterRootSpan;

impl RootSpanBuilder for LimiterRootSpan {
    fn on_request_start(request: &ServiceRequest) -> Span {
        let span = tracing_actix_web::root_span!(
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
        );
        // The macro names the span after any method a client sends; span metrics (Tempo's)
        // label by that name, so each invented method would be series of their own.
        let method = method_label(request.method());
        if method == METHOD_OTHER {
            let route = request
                .match_pattern()
                .unwrap_or_else(|| "default".to_owned());
            span.record("http.method", method);
            // Its OpenTelemetry span is built by now (a `traceparent` is read as the span is
            // made), and a recorded `otel.name` renames only a span not yet built.
            span.context()
                .span()
                .update_name(format!("{method} {route}"));
        }
        span
    }

    fn on_request_end<B: MessageBody>(span: Span, outcome: &Result<ServiceResponse<B>, Error>) {
        DefaultRootSpanBuilder::on_request_end(span, outcome);
    }
}
