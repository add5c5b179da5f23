//! The IETF rate-limit header fields (draft-ietf-httpapi-ratelimit-headers, -10 and later):
//! `RateLimit-Policy: "free";q=5;w=30` and `RateLimit: "free";r=3;t=27`, plus `Retry-After`.

use actix_web::http::header::{HeaderMap, HeaderName, HeaderValue};

use crate::limiter::Quota;

pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
pub const RETRY_AFTER: HeaderName = actix_web::http::header::RETRY_AFTER;

/// `"<plan>";q=<quota>;w=<window seconds>`. Plan names are `[A-Za-z0-9_-]`, safe in a string item.
pub fn policy_value(plan: &str, quota: &Quota) -> String {
    format!("\"{plan}\";q={};w={}", quota.limit, quota.window_seconds)
}

/// `"<plan>";r=<remaining>;t=<seconds until the quota is whole again>`.
pub fn ratelimit_value(plan: &str, quota: &Quota) -> String {
    format!("\"{plan}\";r={};t={}", quota.remaining, quota.reset_seconds)
}

/// Adds both fields, and `Retry-After` when given.
pub fn insert(
    headers: &mut HeaderMap,
    plan: &str,
    quota: &Quota,
    retry_after_seconds: Option<u64>,
) {
    let value = |s: String| HeaderValue::from_str(&s).expect("header values are ASCII");
    headers.insert(RATELIMIT_POLICY, value(policy_value(plan, quota)));
    headers.insert(RATELIMIT, value(ratelimit_value(plan, quota)));
    if let Some(seconds) = retry_after_seconds {
        headers.insert(RETRY_AFTER, HeaderValue::from(seconds));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn field_values_follow_the_draft() {
        let quota = Quota {
            limit: 5,
            window_seconds: 30,
            remaining: 3,
            reset_seconds: 27,
        };
        assert_eq!(policy_value("free", &quota), "\"free\";q=5;w=30");
        assert_eq!(ratelimit_value("free", &quota), "\"free\";r=3;t=27");
        let mut headers = HeaderMap::new();
        insert(&mut headers, "free", &quota, Some(12));
        assert_eq!(headers.get("retry-after").unwrap(), "12");
        assert_eq!(
            headers.get("RateLimit-Policy").unwrap(),
            "\"free\";q=5;w=30"
        );
    }
}
