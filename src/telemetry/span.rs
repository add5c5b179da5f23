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
use tracing_actix_web::{RequestId, RootSpanBuilder};
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

/// `network.protocol.version`, as OpenTelemetry writes HTTP's (`2`, not `2.0`).
fn protocol_version(version: actix_web::http::Version) -> &'static str {
    use actix_web::http::Version;
    match version {
        Version::HTTP_09 => "0.9",
        Version::HTTP_10 => "1.0",
        Version::HTTP_11 => "1.1",
        Version::HTTP_2 => "2",
        Version::HTTP_3 => "3",
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

/// A host as `server.address` and `server.port` name it: `host[:port]`, an IPv6 address in
/// brackets (without them in the address). No port, or one that is no number: none.
fn server_address(host: &str) -> (&str, Option<u16>) {
    if let Some(bracketed) = host.strip_prefix('[') {
        if let Some((address, rest)) = bracketed.split_once(']') {
            return (address, rest.strip_prefix(':').and_then(|p| p.parse().ok()));
        }
        return (host, None);
    }
    match host.rsplit_once(':') {
        Some((address, port)) => match port.parse() {
            Ok(port) => (address, Some(port)),
            Err(_) => (host, None),
        },
        None => (host, None),
    }
}

/// The server span of every request, named and filled after OpenTelemetry's stable HTTP
/// conventions (v1.26: `http.request.method`, `url.path`, `http.response.status_code`, ...),
/// with the limiter's fields declared (empty until recorded).
///
/// Made here rather than by tracing-actix-web's `root_span!`, which writes the conventions'
/// older names and records the path with its query string (`?access_token=…` would be exported
/// in every trace) and the client address, host and scheme from `X-Forwarded-For`, `-Host`,
/// `-Proto` or `Forwarded`, which any client writes (a trace would name whoever the client
/// claimed to be). Here `url.path` is the path alone (no `url.query`), `client.address` the
/// connection's peer, `server.address` the request's own host and `url.scheme` the listener's.
/// The method is bounded (`_OTHER`, the span named `HTTP`), so that a client's invented method
/// names no span (Tempo's span metrics label by the name); an unmatched path has no
/// `http.route` and its span is named by the method alone.
pub struct LimiterRootSpan;

impl RootSpanBuilder for LimiterRootSpan {
    fn on_request_start(request: &ServiceRequest) -> Span {
        let method = method_label(request.method());
        let route = request.match_pattern();
        let user_agent = request.headers().get("User-Agent");
        let user_agent = capped(user_agent.and_then(|v| v.to_str().ok()).unwrap_or(""));
        let peer = request.peer_addr().map(|peer| peer.ip().to_string());
        let scheme = if request.app_config().secure() {
            "https"
        } else {
            "http"
        };
        let (address, port) = server_address(capped(host(request)));
        let span = tracing::info_span!(
            "HTTP request",
            http.request.method = method,
            http.request.method_original = tracing::field::Empty,
            http.route = tracing::field::Empty,
            network.protocol.version = protocol_version(request.version()),
            url.scheme = scheme,
            url.path = capped(request.path()),
            server.address = address,
            server.port = tracing::field::Empty,
            client.address = peer.as_deref().unwrap_or(""),
            user_agent.original = user_agent,
            http.response.status_code = tracing::field::Empty,
            error.type = tracing::field::Empty,
            otel.name = %span_name(method, route.as_deref()),
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
        if let Some(route) = route {
            span.record("http.route", route);
        }
        if let Some(port) = port {
            // An i64: tracing-opentelemetry exports an unsigned integer as text, and the
            // conventions' port (and status code) are integers.
            span.record("server.port", i64::from(port));
        }
        if method == METHOD_OTHER {
            span.record(
                "http.request.method_original",
                capped(request.method().as_str()),
            );
        }
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

    /// The response's status; an error's message and details when actix carries one. The span's
    /// status is `ERROR` for a 5xx, the limiter's own included (failed closed, a caller it cannot
    /// resolve: tracing-actix-web's default marks only responses that carry an actix error, and
    /// a ledger outage showed no error in any trace), with `error.type` the status code; else
    /// unset, as the conventions ask of a server's 4xx (the default set `OK`, which is the
    /// application's to set).
    fn on_request_end<B: MessageBody>(span: Span, outcome: &Result<ServiceResponse<B>, Error>) {
        let (status, error) = match outcome {
            Ok(response) => {
                let error = response.response().error();
                (response.status(), error.map(|e| e.as_response_error()))
            }
            Err(error) => {
                let error = error.as_response_error();
                (error.status_code(), Some(error))
            }
        };
        span.record("http.response.status_code", i64::from(status.as_u16()));
        if let Some(error) = error {
            // Formatted first: tracing drops a `Display` value's field otherwise
            // (tokio-rs/tracing#1565, as tracing-actix-web does).
            let (message, details) = (format!("{error}"), format!("{error:?}"));
            span.record("exception.message", message.as_str());
            span.record("exception.details", details.as_str());
        }
        if status.is_server_error() {
            span.record("otel.status_code", "ERROR");
            span.record("error.type", status.as_str());
        }
    }
}

/// A server span's name: `{method} {route}`; the method alone when no route matched; `HTTP`
/// for a method outside the standard ones (the conventions' names).
fn span_name(method: &'static str, route: Option<&str>) -> String {
    let method = if method == METHOD_OTHER {
        "HTTP"
    } else {
        method
    };
    match route {
        Some(route) => format!("{method} {route}"),
        None => method.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_names_its_address_and_port() {
        assert_eq!(server_address("127.0.0.1:8080"), ("127.0.0.1", Some(8080)));
        assert_eq!(server_address("api.example"), ("api.example", None));
        assert_eq!(server_address("[::1]:443"), ("::1", Some(443)));
        assert_eq!(server_address("[::1]"), ("::1", None));
        assert_eq!(server_address("[::1"), ("[::1", None));
        assert_eq!(server_address("host:http"), ("host:http", None));
        assert_eq!(server_address("host:99999"), ("host:99999", None));
        assert_eq!(server_address(""), ("", None));
    }

    #[test]
    fn a_span_is_named_by_its_method_and_route() {
        assert_eq!(span_name("GET", Some("/greeting")), "GET /greeting");
        assert_eq!(span_name("POST", None), "POST");
        assert_eq!(span_name(METHOD_OTHER, Some("/greeting")), "HTTP /greeting");
        assert_eq!(span_name(METHOD_OTHER, None), "HTTP");
    }
}
