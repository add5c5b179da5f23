//! The IETF rate-limit header fields (draft-ietf-httpapi-ratelimit-headers, -10 and later):
//! `RateLimit-Policy: "free";q=5;w=30` and `RateLimit: "free";r=3;t=27`, plus `Retry-After`.

use actix_web::http::header::{HeaderMap, HeaderName, HeaderValue};

use crate::limiter::plan::{Plan, PlanBook, PlanId};
use crate::limiter::Quota;

pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
pub const RETRY_AFTER: HeaderName = actix_web::http::header::RETRY_AFTER;

/// `"<plan>";q=<quota>;w=<window seconds>`. Plan names are `[A-Za-z0-9_-]`, safe in a string item.
pub fn policy_value(plan: &Plan) -> String {
    format!(
        "\"{}\";q={};w={}",
        plan.name(),
        plan.capacity(),
        plan.window_seconds()
    )
}

/// `"<plan>";r=<remaining>;t=<seconds until the quota is whole again>`.
pub fn ratelimit_value(plan: &str, quota: &Quota) -> String {
    format!("\"{plan}\";r={};t={}", quota.remaining, quota.reset_seconds)
}

/// `RateLimit-Policy` never changes for a plan: made once per plan of a book, found by
/// [`PlanId`].
#[derive(Debug, Clone)]
pub struct PolicyHeaders(Vec<(Plan, HeaderValue)>);

impl PolicyHeaders {
    pub fn new(plans: &PlanBook) -> Self {
        PolicyHeaders(
            plans
                .plans()
                .iter()
                .map(|plan| (plan.clone(), policy_header(plan)))
                .collect(),
        )
    }

    /// The field for `plan`; made afresh for a plan of another book (a library user mixing
    /// limiters) rather than showing a wrong one.
    pub fn get(&self, id: PlanId, plan: &Plan) -> HeaderValue {
        match self.0.get(id.index()) {
            Some((known, value)) if known == plan => value.clone(),
            _ => policy_header(plan),
        }
    }
}

fn policy_header(plan: &Plan) -> HeaderValue {
    HeaderValue::try_from(policy_value(plan)).expect("plan names are header-safe")
}

/// Adds both fields, and `Retry-After` when given.
pub fn insert(
    headers: &mut HeaderMap,
    plan: &str,
    policy: HeaderValue,
    quota: &Quota,
    retry_after_seconds: Option<u64>,
) {
    headers.insert(RATELIMIT_POLICY, policy);
    headers.insert(
        RATELIMIT,
        HeaderValue::try_from(ratelimit_value(plan, quota)).expect("header values are ASCII"),
    );
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
        let free = crate::limiter::plan::test_plan("free", 5);
        assert_eq!(policy_value(&free), "\"free\";q=5;w=30");
        assert_eq!(ratelimit_value("free", &quota), "\"free\";r=3;t=27");
        let book = PlanBook::new(
            vec![free.clone()],
            "free",
            [],
            [],
            crate::limiter::plan::UnknownKeys::DefaultPlan,
        )
        .unwrap();
        let fields = PolicyHeaders::new(&book);
        let policy = fields.get(book.default_plan(), &free);
        assert_eq!(policy, "\"free\";q=5;w=30");
        let other = crate::limiter::plan::test_plan("other", 7);
        assert_eq!(
            fields.get(book.default_plan(), &other),
            "\"other\";q=7;w=30"
        );
        let mut headers = HeaderMap::new();
        insert(&mut headers, "free", policy, &quota, Some(12));
        assert_eq!(headers.get("retry-after").unwrap(), "12");
        assert_eq!(
            headers.get("RateLimit-Policy").unwrap(),
            "\"free\";q=5;w=30"
        );
    }
}
