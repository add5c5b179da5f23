//! The request's server span and the limiter's fields on it. The names are declared here once:
//! [`LimiterRootSpan`] creates them empty, the limiter records them (recording a field a span does
//! not declare is a no-op, so both must change together).

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::Method;
use actix_web::Error;
use actix_web::HttpMessage;
use opentelemetry::trace::TraceContextExt;
use tracing::Span;
use tracing_actix_web::{DefaultRootSpanBuilder, RequestId, RootSpanBuilder};
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

/// A request's headers, as OpenTelemetry's propagators read them.
struct HeaderCarrier<'a>(&'a actix_web::http::header::HeaderMap);

impl opentelemetry::propagation::Extractor for HeaderCarrier<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|value| value.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|name| name.as_str()).collect()
    }
}

fn http_flavor(version: actix_web::http::Version) -> &'static str {
    use actix_web::http::Version;
    match version {
        Version::HTTP_09 => "0.9",
        Version::HTTP_10 => "1.0",
        Version::HTTP_11 => "1.1",
        Version::HTTP_2 => "2.0",
        Version::HTTP_3 => "3.0",
        _ => "other",
    }
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

/// The most of a client-written field (the host, the user agent) a span carries.
const SPAN_FIELD_BYTES_MAX: usize = 256;

/// `text` up to [`SPAN_FIELD_BYTES_MAX`] (cut at a character's boundary): kilobytes of a
/// client's header in every exported span are its to fill our traces with.
fn capped(text: &str) -> &str {
    if text.len() <= SPAN_FIELD_BYTES_MAX {
        return text;
    }
    let mut end = SPAN_FIELD_BYTES_MAX;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// The host the request was sent to: its `Host` field (HTTP/1.1), else its URI's authority
/// (HTTP/2). Not actix's `connection_info().host()`, which believes `Forwarded: host=` and
/// `X-Forwarded-Host` from any client.
fn host(request: &ServiceRequest) -> &str {
    let field = request.headers().get(actix_web::http::header::HOST);
    field
        .and_then(|host| host.to_str().ok())
        .or_else(|| {
            request
                .uri()
                .authority()
                .map(|authority| authority.as_str())
        })
        .unwrap_or("")
}

/// The server span of every request, with the limiter's fields declared (empty until recorded).
///
/// tracing-actix-web's fields, made here rather than by its `root_span!`: that macro records the
/// path with its query string (`?access_token=…` would be exported in every trace) and the
/// client address, host and scheme from `X-Forwarded-For`, `-Host`, `-Proto` or `Forwarded`,
/// which any client writes (a trace would name whoever the client claimed to be). Here
/// `http.target` is the path alone, `http.client_ip` the connection's peer, `http.host` the
/// request's own and `http.scheme` the listener's; the method is bounded (`_OTHER`), so that a client's
/// invented method names no span (Tempo's span metrics label by the name).
pub struct LimiterRootSpan;

impl RootSpanBuilder for LimiterRootSpan {
    fn on_request_start(request: &ServiceRequest) -> Span {
        let method = method_label(request.method());
        let route = request.match_pattern();
        let route = route.as_deref().unwrap_or("default");
        let user_agent = request.headers().get("User-Agent");
        let user_agent = capped(user_agent.and_then(|v| v.to_str().ok()).unwrap_or(""));
        let peer = request.peer_addr().map(|peer| peer.ip().to_string());
        let scheme = if request.app_config().secure() {
            "https"
        } else {
            "http"
        };
        let span = tracing::info_span!(
            "HTTP request",
            http.method = method,
            http.route = route,
            http.flavor = http_flavor(request.version()),
            http.scheme = scheme,
            http.host = capped(host(request)),
            http.client_ip = peer.as_deref().unwrap_or(""),
            http.user_agent = user_agent,
            http.target = capped(request.path()),
            http.status_code = tracing::field::Empty,
            otel.name = %format_args!("{method} {route}"),
            otel.kind = "server",
            otel.status_code = tracing::field::Empty,
            trace_id = tracing::field::Empty,
            request_id = tracing::field::Empty,
            exception.message = tracing::field::Empty,
            exception.details = tracing::field::Empty,
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
        // TracingLogger makes one before it calls this.
        if let Some(request_id) = request.extensions().get::<RequestId>() {
            span.record("request_id", tracing::field::display(request_id));
        }
        // A `traceparent` makes this span its caller's child, in its trace.
        let parent = opentelemetry::global::get_text_map_propagator(|propagator| {
            propagator.extract(&HeaderCarrier(request.headers()))
        });
        let _ = span.set_parent(parent);
        let trace_id = span.context().span().span_context().trace_id();
        span.record("trace_id", tracing::field::display(trace_id));
        span
    }

    /// As tracing-actix-web's, but a 5xx the limiter answers itself (failed closed, a caller it
    /// cannot resolve) is an error too: the default marks only responses that carry an actix
    /// error, and exported these `OK`, so a ledger outage showed no error in any trace. (Not
    /// `ERROR` after the default's `OK`: OpenTelemetry keeps a span's `OK` once set.)
    fn on_request_end<B: MessageBody>(span: Span, outcome: &Result<ServiceResponse<B>, Error>) {
        match outcome {
            Ok(response)
                if response.response().error().is_none() && response.status().is_server_error() =>
            {
                span.record("http.status_code", i32::from(response.status().as_u16()));
                span.record("otel.status_code", "ERROR");
            }
            _ => DefaultRootSpanBuilder::on_request_end(span, outcome),
        }
    }
}
