//! The IETF rate-limit header fields (draft-ietf-httpapi-ratelimit-headers, -10 and later):
//! `RateLimit-Policy: "free";q=5;w=30` and `RateLimit: "free";r=3;t=27`, plus `Retry-After`.

use std::sync::OnceLock;

use actix_web::http::header::{HeaderMap, HeaderName, HeaderValue};

use crate::limiter::plan::{Plan, PlanBook, PlanId, PLAN_NAME_LENGTH_MAX};
use crate::limiter::Quota;

pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
pub const RETRY_AFTER: HeaderName = actix_web::http::header::RETRY_AFTER;

/// The token of an `Authorization: Bearer <token>` value; the scheme's name in any case
/// (RFC 9110 §11.1). For the admin API's secrets, and for callers keyed by their bearer token.
pub fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    let (scheme, token) = value.split_at_checked(b"bearer ".len())?;
    let token = token.trim_ascii_start();
    (scheme.eq_ignore_ascii_case(b"bearer ") && !token.is_empty()).then_some(token)
}

/// `"<plan>";q=<quota>;w=<window seconds>`. Plan names are `[A-Za-z0-9_-]`, safe in a string item.
pub fn policy_value(plan: &Plan) -> String {
    format!(
        "\"{}\";q={};w={}",
        plan.name(),
        plan.capacity(),
        plan.window_seconds()
    )
}

/// `"<plan>";r=<remaining>;t=<seconds until more of the quota is back>`.
pub fn ratelimit_value(plan: &str, quota: &Quota) -> String {
    format!("\"{plan}\";r={};t={}", quota.remaining, quota.reset_seconds)
}

/// [`ratelimit_value`] as a field, on every response of a limited route: written without the
/// formatting machinery, and remembered per worker for an exhausted caller, who is refused with
/// the same field many times a second.
pub fn ratelimit_field(plan: &str, quota: &Quota) -> HeaderValue {
    let make = || {
        assert!(plan.len() <= PLAN_NAME_LENGTH_MAX, "plan names are bounded");
        let (mut remaining, mut reset) = (itoa::Buffer::new(), itoa::Buffer::new());
        let parts: [&[u8]; 6] = [
            b"\"",
            plan.as_bytes(),
            b"\";r=",
            remaining.format(quota.remaining).as_bytes(),
            b";t=",
            reset.format(quota.reset_seconds).as_bytes(),
        ];
        let mut field = [0u8; RATELIMIT_FIELD_BYTES_MAX];
        let mut length = 0;
        for part in parts {
            field[length..length + part.len()].copy_from_slice(part);
            length += part.len();
        }
        // Copied once into a buffer of its own size: a `Vec` handed over as `Bytes` would take a
        // second allocation, for the shared header of its spare capacity.
        HeaderValue::from_bytes(&field[..length]).expect("plan names are header-safe")
    };
    if quota.remaining == 0 {
        super::repeats::exhausted_ratelimit_field(plan, quota, make)
    } else {
        make()
    }
}

/// The longest `RateLimit` field: a plan name at its bound, two numbers of up to 20 digits and
/// the 8 bytes around them.
const RATELIMIT_FIELD_BYTES_MAX: usize = PLAN_NAME_LENGTH_MAX + 2 * 20 + 8;

/// Counts of seconds up to this are made once for the process.
const SECONDS_VALUES_MAX: u64 = 3600;

/// A count of seconds (`Retry-After`, …) as a field. Counts up to an hour, nearly all of them,
/// come from one table made once: a fresh `HeaderValue` is an allocation.
pub fn seconds_field(seconds: u64) -> HeaderValue {
    static TABLE: OnceLock<Vec<HeaderValue>> = OnceLock::new();
    if seconds > SECONDS_VALUES_MAX {
        return HeaderValue::from(seconds);
    }
    let table = TABLE.get_or_init(|| {
        // One string for all of them, kept for the life of the process (about 15 KiB).
        let mut all = String::new();
        let mut ends = Vec::with_capacity(SECONDS_VALUES_MAX as usize + 1);
        for n in 0..=SECONDS_VALUES_MAX {
            all.push_str(itoa::Buffer::new().format(n));
            ends.push(all.len());
        }
        let all: &'static str = Box::leak(all.into_boxed_str());
        let mut start = 0;
        ends.into_iter()
            .map(|end| {
                let value = HeaderValue::from_static(&all[start..end]);
                start = end;
                value
            })
            .collect()
    });
    table[seconds as usize].clone()
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

/// The header styles clients already parse; the IETF fields by default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeaderStyles {
    /// `RateLimit-Policy` and `RateLimit` (draft-ietf-httpapi-ratelimit-headers).
    pub ietf: bool,
    /// GitHub's `X-RateLimit-Limit`, `-Remaining`, `-Reset` (epoch seconds) and `-Used`.
    pub github: bool,
    /// bucket4j's `X-Rate-Limit-Remaining`, and `X-Rate-Limit-Retry-After-Seconds` on a refusal.
    pub bucket4j: bool,
}

impl Default for HeaderStyles {
    fn default() -> Self {
        HeaderStyles {
            ietf: true,
            github: false,
            bucket4j: false,
        }
    }
}

impl HeaderStyles {
    /// From names; `Err` names the first unknown one (or is empty when no style is given).
    pub fn parse(names: &[String]) -> Result<Self, String> {
        let mut styles = HeaderStyles {
            ietf: false,
            github: false,
            bucket4j: false,
        };
        for name in names {
            match name.as_str() {
                "ietf" => styles.ietf = true,
                "github" => styles.github = true,
                "bucket4j" => styles.bucket4j = true,
                other => return Err(other.to_owned()),
            }
        }
        if names.is_empty() {
            return Err(String::new());
        }
        Ok(styles)
    }
}

pub const X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
pub const X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
pub const X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");
pub const X_RATELIMIT_USED: HeaderName = HeaderName::from_static("x-ratelimit-used");
pub const X_RATE_LIMIT_REMAINING: HeaderName = HeaderName::from_static("x-rate-limit-remaining");
pub const X_RATE_LIMIT_RETRY_AFTER_SECONDS: HeaderName =
    HeaderName::from_static("x-rate-limit-retry-after-seconds");

/// Adds the fields of every style, and `Retry-After` when given.
pub fn insert(
    headers: &mut HeaderMap,
    styles: HeaderStyles,
    plan: &str,
    policy: HeaderValue,
    quota: &Quota,
    retry_after_seconds: Option<u64>,
) {
    if styles.ietf {
        headers.insert(RATELIMIT_POLICY, policy);
        headers.insert(RATELIMIT, ratelimit_field(plan, quota));
    }
    if styles.github {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        headers.insert(X_RATELIMIT_LIMIT, HeaderValue::from(quota.limit));
        headers.insert(X_RATELIMIT_REMAINING, HeaderValue::from(quota.remaining));
        let reset = reset_epoch_seconds(now, quota.reset_seconds);
        headers.insert(X_RATELIMIT_RESET, HeaderValue::from(reset));
        let used = quota.limit.saturating_sub(quota.remaining);
        headers.insert(X_RATELIMIT_USED, HeaderValue::from(used));
    }
    if styles.bucket4j {
        headers.insert(X_RATE_LIMIT_REMAINING, HeaderValue::from(quota.remaining));
        if let Some(seconds) = retry_after_seconds {
            headers.insert(X_RATE_LIMIT_RETRY_AFTER_SECONDS, seconds_field(seconds));
        }
    }
    if let Some(seconds) = retry_after_seconds {
        headers.insert(RETRY_AFTER, seconds_field(seconds));
    }
}

/// GitHub's `X-RateLimit-Reset`, in seconds since the epoch: `reset_seconds` from `now` (since
/// the epoch), with `now` rounded up, as `reset_seconds` is. Rounded down, it fell up to a
/// second before the credit is back (and before `Retry-After`): a client that slept until it
/// retried early, into another 429.
fn reset_epoch_seconds(now: std::time::Duration, reset_seconds: u64) -> u64 {
    let now_seconds = now.as_secs() + u64::from(now.subsec_nanos() > 0);
    now_seconds.saturating_add(reset_seconds)
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
        insert(
            &mut headers,
            HeaderStyles::default(),
            "free",
            policy.clone(),
            &quota,
            Some(12),
        );
        assert!(headers.get("x-ratelimit-limit").is_none());
        assert_eq!(headers.get("retry-after").unwrap(), "12");
        assert_eq!(
            headers.get("RateLimit-Policy").unwrap(),
            "\"free\";q=5;w=30"
        );
    }

    #[test]
    fn every_style_says_the_same_quota() {
        let quota = Quota {
            limit: 5,
            window_seconds: 30,
            remaining: 0,
            reset_seconds: 27,
        };
        let all = HeaderStyles::parse(&["ietf".into(), "github".into(), "bucket4j".into()]);
        let mut headers = HeaderMap::new();
        let policy = HeaderValue::from_static("\"free\";q=5;w=30");
        let epoch =
            |time: std::time::SystemTime| time.duration_since(std::time::UNIX_EPOCH).unwrap();
        let before = epoch(std::time::SystemTime::now());
        insert(&mut headers, all.unwrap(), "free", policy, &quota, Some(27));
        let after = epoch(std::time::SystemTime::now());
        assert_eq!(headers.get("ratelimit").unwrap(), "\"free\";r=0;t=27");
        assert_eq!(headers.get("x-ratelimit-limit").unwrap(), "5");
        assert_eq!(headers.get("x-ratelimit-remaining").unwrap(), "0");
        assert_eq!(headers.get("x-ratelimit-used").unwrap(), "5");
        let reset: u64 = headers
            .get("x-ratelimit-reset")
            .unwrap()
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        // The credit is back 27 s from the call, rounded up to a whole second: never sooner.
        let up = |time: std::time::Duration| time.as_secs() + u64::from(time.subsec_nanos() > 0);
        assert!(
            (up(before) + 27..=up(after) + 27).contains(&reset),
            "{before:?} {reset}"
        );
        assert_eq!(headers.get("x-rate-limit-remaining").unwrap(), "0");
        assert_eq!(
            headers.get("x-rate-limit-retry-after-seconds").unwrap(),
            "27"
        );
        assert_eq!(headers.get("retry-after").unwrap(), "27");
        assert_eq!(HeaderStyles::parse(&["nope".into()]), Err("nope".into()));
        assert_eq!(HeaderStyles::parse(&[]), Err(String::new()));
    }

    #[test]
    fn githubs_reset_is_never_before_the_credit_is_back() {
        use std::time::Duration;
        assert_eq!(reset_epoch_seconds(Duration::from_millis(100_800), 27), 128);
        assert_eq!(reset_epoch_seconds(Duration::from_millis(100_001), 3), 104);
        assert_eq!(reset_epoch_seconds(Duration::from_secs(100), 27), 127);
        assert_eq!(
            reset_epoch_seconds(Duration::from_secs(100), u64::MAX),
            u64::MAX
        );
    }

    /// The fast, remembered fields are the formatted ones, at the edges of the table and past it.
    #[test]
    fn fields_are_the_formatted_values() {
        for seconds in [0, 1, 9, 10, 99, 100, 3599, 3600, 3601, 86_400, u64::MAX] {
            assert_eq!(seconds_field(seconds), seconds.to_string().as_str());
        }
        let longest = "p".repeat(PLAN_NAME_LENGTH_MAX);
        let pairs = [
            (0, 0),
            (0, 27),
            (0, 27),
            (3, 27),
            (u64::MAX, 1),
            (u64::MAX, u64::MAX),
        ];
        for (remaining, reset_seconds) in pairs {
            let quota = Quota {
                limit: 5,
                window_seconds: 30,
                remaining,
                reset_seconds,
            };
            for plan in ["free", "pro_2-x", &longest] {
                let field = ratelimit_field(plan, &quota);
                assert_eq!(field, ratelimit_value(plan, &quota).as_str());
            }
        }
    }
}
