//! RFC 9457 problem details (`application/problem+json`) for every response the limiter makes.

use actix_web::http::header::{self, HeaderValue};
use actix_web::http::StatusCode;
use actix_web::web::Bytes;
use actix_web::HttpResponse;

pub const CONTENT_TYPE: &str = "application/problem+json";

/// The problems the limiter answers with. `type` URIs are stable identifiers (documented in the
/// README), not links.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProblemKind {
    MissingKey,
    InvalidKey,
    UnknownKey,
    RateLimited,
    /// An operator blocked the caller for a while (admin API).
    Blocked,
    LedgerUnavailable,
    /// The caller is known by its address, and the request has none (served over a Unix
    /// socket with no trusted proxy's header): the deployment's fault, not the caller's.
    CallerUnknown,
    /// An admin API request that could not be carried out (its status says why).
    Admin,
}

impl ProblemKind {
    pub fn status(self) -> StatusCode {
        match self {
            ProblemKind::MissingKey | ProblemKind::UnknownKey => StatusCode::UNAUTHORIZED,
            ProblemKind::InvalidKey => StatusCode::BAD_REQUEST,
            ProblemKind::RateLimited => StatusCode::TOO_MANY_REQUESTS,
            ProblemKind::Blocked => StatusCode::FORBIDDEN,
            ProblemKind::LedgerUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            ProblemKind::CallerUnknown => StatusCode::INTERNAL_SERVER_ERROR,
            ProblemKind::Admin => StatusCode::BAD_REQUEST,
        }
    }

    pub fn type_uri(self) -> &'static str {
        match self {
            ProblemKind::MissingKey => "urn:ledger-limiter:problem:missing-api-key",
            ProblemKind::InvalidKey => "urn:ledger-limiter:problem:invalid-api-key",
            ProblemKind::UnknownKey => "urn:ledger-limiter:problem:unknown-api-key",
            ProblemKind::RateLimited => "urn:ledger-limiter:problem:rate-limited",
            ProblemKind::Blocked => "urn:ledger-limiter:problem:blocked",
            ProblemKind::LedgerUnavailable => "urn:ledger-limiter:problem:ledger-unavailable",
            ProblemKind::CallerUnknown => "urn:ledger-limiter:problem:caller-unknown",
            ProblemKind::Admin => "urn:ledger-limiter:problem:admin",
        }
    }

    pub fn title(self) -> &'static str {
        match self {
            ProblemKind::MissingKey => "API key required",
            ProblemKind::InvalidKey => "Invalid API key",
            ProblemKind::UnknownKey => "Unknown API key",
            ProblemKind::RateLimited => "Rate limit exceeded",
            ProblemKind::Blocked => "Caller blocked",
            ProblemKind::LedgerUnavailable => "Rate limiter unavailable",
            ProblemKind::CallerUnknown => "Caller unknown",
            ProblemKind::Admin => "Admin request refused",
        }
    }
}

/// Builds the response. `detail` must never contain a secret (it is shown to the caller).
pub fn response(kind: ProblemKind, detail: &str) -> HttpResponse {
    with_status(kind, kind.status(), detail)
}

/// The same, with a configured status instead of the kind's own (a missing key as 400).
pub fn with_status(kind: ProblemKind, status: StatusCode, detail: &str) -> HttpResponse {
    with_body(status, Bytes::from(body(kind, status, detail)))
}

/// [`with_status`] with one more member, `name` set to `value` (both constants, with nothing to
/// escape): a machine-readable cause beside the detail, which is for people (an RFC 9457
/// extension member).
pub fn with_member(
    kind: ProblemKind,
    status: StatusCode,
    detail: &str,
    (name, value): (&'static str, &'static str),
) -> HttpResponse {
    let mut body = body(kind, status, detail);
    assert_eq!(body.pop(), Some('}'), "a JSON object");
    for part in [",\"", name, "\":\"", value, "\"}"] {
        body.push_str(part);
    }
    with_body(status, Bytes::from(body))
}

/// A problem response around a body [`body_bytes`] made (perhaps earlier: see `repeats`).
pub fn with_body(status: StatusCode, body: Bytes) -> HttpResponse {
    const CONTENT_TYPE_FIELD: HeaderValue = HeaderValue::from_static(CONTENT_TYPE);
    let mut response = HttpResponse::with_body(status, body);
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, CONTENT_TYPE_FIELD);
    response.map_into_boxed_body()
}

/// The body of a problem of `kind`, for [`with_body`].
pub fn body_bytes(kind: ProblemKind, detail: &str) -> Bytes {
    Bytes::from(body(kind, kind.status(), detail))
}

/// `{"type":…,"title":…,"status":…,"detail":…}`, written straight into one buffer: a refusal
/// from memory is answered by the thousand per second, and a serializer cost more than the rest
/// of the body together. `type` and `title` are constants with nothing to escape.
fn body(kind: ProblemKind, status: StatusCode, detail: &str) -> String {
    let mut body = String::with_capacity(BODY_FIXED_BYTES_MAX + detail.len() + detail.len() / 8);
    body.push_str(r#"{"type":""#);
    body.push_str(kind.type_uri());
    body.push_str(r#"","title":""#);
    body.push_str(kind.title());
    body.push_str(r#"","status":"#);
    body.push_str(status.as_str());
    body.push_str(r#","detail":""#);
    push_json_escaped(&mut body, detail);
    body.push_str(r#""}"#);
    body
}

/// Room for everything but the detail: the longest type and title and the punctuation.
const BODY_FIXED_BYTES_MAX: usize = 160;

/// Appends `text` as the inside of a JSON string (RFC 8259 section 7), escaping as `serde_json`
/// does: `"` and `\`, the short forms of five control characters, `\u00XX` for the rest.
fn push_json_escaped(out: &mut String, text: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut start = 0;
    for (index, byte) in text.bytes().enumerate() {
        let short = match byte {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            b'\n' => "\\n",
            b'\r' => "\\r",
            b'\t' => "\\t",
            0x08 => "\\b",
            0x0c => "\\f",
            0x00..=0x1f => "",
            _ => continue,
        };
        out.push_str(&text[start..index]);
        if short.is_empty() {
            out.push_str("\\u00");
            out.push(char::from(HEX[usize::from(byte >> 4)]));
            out.push(char::from(HEX[usize::from(byte & 0xf)]));
        } else {
            out.push_str(short);
        }
        start = index + 1;
    }
    out.push_str(&text[start..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_and_body() {
        assert_eq!(ProblemKind::RateLimited.status(), 429);
        assert_eq!(ProblemKind::MissingKey.status(), 401);
        assert_eq!(ProblemKind::InvalidKey.status(), 400);
        assert_eq!(ProblemKind::LedgerUnavailable.status(), 503);
        let res = response(ProblemKind::RateLimited, "try later");
        assert_eq!(res.status(), 429);
        assert_eq!(res.headers().get("content-type").unwrap(), CONTENT_TYPE);
    }

    /// The hand-written body is what a JSON serializer would write, escapes included.
    #[test]
    fn body_is_the_serializers_json() {
        let kinds = [
            ProblemKind::MissingKey,
            ProblemKind::InvalidKey,
            ProblemKind::UnknownKey,
            ProblemKind::RateLimited,
            ProblemKind::Blocked,
            ProblemKind::LedgerUnavailable,
            ProblemKind::Admin,
        ];
        let details = [
            "",
            "plan free allows 5 units per 30 s; retry after 7 s",
            "quote \" backslash \\ slash / tab \t newline \n cr \r",
            "controls \u{0} \u{1} \u{8} \u{c} \u{1f} del \u{7f}",
            "unicode é ✓ 🦀",
        ];
        for kind in kinds {
            assert!(kind.type_uri().len() + kind.title().len() + 60 <= BODY_FIXED_BYTES_MAX);
            for detail in details {
                let expected = serde_json::json!({
                    "type": kind.type_uri(),
                    "title": kind.title(),
                    "status": kind.status().as_u16(),
                    "detail": detail,
                });
                let written = body(kind, kind.status(), detail);
                let parsed: serde_json::Value = serde_json::from_str(&written).expect(&written);
                assert_eq!(parsed, expected, "{written}");
                let serde_written = format!(
                    r#"{{"type":{},"title":{},"status":{},"detail":{}}}"#,
                    serde_json::to_string(kind.type_uri()).unwrap(),
                    serde_json::to_string(kind.title()).unwrap(),
                    kind.status().as_u16(),
                    serde_json::to_string(detail).unwrap()
                );
                assert_eq!(written, serde_written);
            }
        }
    }
}
