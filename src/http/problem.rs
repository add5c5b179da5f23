//! RFC 9457 problem details (`application/problem+json`) for every response the limiter makes.

use actix_web::http::StatusCode;
use actix_web::HttpResponse;
use serde::Serialize;

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
            ProblemKind::Admin => "Admin request refused",
        }
    }
}

#[derive(Debug, Serialize)]
struct Body<'a> {
    #[serde(rename = "type")]
    type_uri: &'a str,
    title: &'a str,
    status: u16,
    detail: &'a str,
}

/// Builds the response. `detail` must never contain a secret (it is shown to the caller).
pub fn response(kind: ProblemKind, detail: &str) -> HttpResponse {
    with_status(kind, kind.status(), detail)
}

/// The same, with a configured status instead of the kind's own (a missing key as 400).
pub fn with_status(kind: ProblemKind, status: StatusCode, detail: &str) -> HttpResponse {
    let body = Body {
        type_uri: kind.type_uri(),
        title: kind.title(),
        status: status.as_u16(),
        detail,
    };
    HttpResponse::build(status)
        .content_type(CONTENT_TYPE)
        .body(serde_json::to_string(&body).expect("serializable"))
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
}
