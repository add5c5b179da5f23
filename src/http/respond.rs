//! The responses the limiter itself makes (problem bodies with their status), and the rate-limit
//! fields it adds to every response of a limited route.

use actix_web::http::header::{HeaderMap, HeaderValue};
use actix_web::http::StatusCode;
use actix_web::HttpResponse;

use super::headers::{self, HeaderStyles, PolicyHeaders};
use super::problem::{self, ProblemKind};
use super::repeats::{self, Refuser};
use crate::limiter::caller::KeyError;
use crate::limiter::plan::{Plan, PlanId};
use crate::limiter::{Decision, Outcome, Quota};
use crate::telemetry::span;

/// 400/401 for a key that is missing (`missing_status`: 401 unless configured 400), malformed or
/// unknown; a 401 carries `challenge` in `WWW-Authenticate`. A request without an address where
/// callers are known by address alone (no `challenge`): 500, the deployment's fault.
pub fn rejected(
    error: &KeyError,
    missing_status: StatusCode,
    challenge: Option<&HeaderValue>,
) -> HttpResponse {
    let (kind, status) = match error {
        // Another scheme's credentials are no key: asked for one, with the challenge (a 400
        // told a client sending Basic credentials nothing it could act on).
        KeyError::Missing { .. } | KeyError::NotBearer { .. } => {
            (ProblemKind::MissingKey, missing_status)
        }
        // A key would name the caller (a key, else the address): ask for one.
        KeyError::NoPeerAddress if challenge.is_some() => (ProblemKind::MissingKey, missing_status),
        // Callers known by address alone: nothing the client could send would name it.
        KeyError::NoPeerAddress => {
            let kind = ProblemKind::CallerUnknown;
            (kind, kind.status())
        }
        KeyError::Unknown => (ProblemKind::UnknownKey, ProblemKind::UnknownKey.status()),
        KeyError::Empty { .. }
        | KeyError::TooLong { .. }
        | KeyError::Malformed { .. }
        | KeyError::Repeated { .. } => (ProblemKind::InvalidKey, ProblemKind::InvalidKey.status()),
    };
    let mut response = problem::with_status(kind, status, &error.to_string());
    if let Some(challenge) = challenge.filter(|_| status == StatusCode::UNAUTHORIZED) {
        let name = actix_web::http::header::WWW_AUTHENTICATE;
        response.headers_mut().insert(name, challenge.clone());
    }
    response
}

/// The largest cost a handler may report (more is a bug, not a cost).
pub const REPORTED_COST_MAX: u64 = 1 << 40;

/// A cost a handler reported in the cost header: ASCII digits, at most [`REPORTED_COST_MAX`].
pub fn reported_cost(value: &HeaderValue) -> Option<u64> {
    let text = value.to_str().ok()?;
    if text.is_empty() || text.len() > 14 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok().filter(|cost| *cost <= REPORTED_COST_MAX)
}

/// How responses carry the quota: the `RateLimit-Policy` values made once, and the styles.
pub struct Fields {
    pub policies: PolicyHeaders,
    pub styles: HeaderStyles,
}

/// Adds the rate-limit fields of every configured style and, when given, `Retry-After`.
pub fn add_fields(
    headers: &mut HeaderMap,
    fields: &Fields,
    decision: &Decision<'_>,
    retry_after_seconds: Option<u64>,
) {
    let plan = (decision.plan_id, decision.plan);
    add_plan_fields(headers, fields, plan, &decision.quota, retry_after_seconds);
    if !decision.route_limits.is_empty() {
        add_route_limits(headers, fields, decision);
    }
}

/// [`add_fields`] for a decision on its plan alone, from its parts.
pub fn add_plan_fields(
    headers: &mut HeaderMap,
    fields: &Fields,
    (plan_id, plan): (PlanId, &Plan),
    quota: &Quota,
    retry_after_seconds: Option<u64>,
) {
    let policy = fields.policies.get(plan_id, plan);
    headers::insert(
        headers,
        fields.styles,
        plan.name(),
        policy,
        quota,
        retry_after_seconds,
    );
}

/// A route with further limits: the IETF fields list every policy (the plan's first), as the
/// draft allows; the single-valued styles show the limit that binds (the one that refused, else
/// the one with the least remaining).
fn add_route_limits(headers: &mut HeaderMap, fields: &Fields, decision: &Decision<'_>) {
    if fields.styles.ietf {
        let mut policy = headers::policy_value(decision.plan);
        let mut ratelimit = headers::ratelimit_value(decision.plan.name(), &decision.quota);
        for limit in &decision.route_limits {
            policy.push_str(", ");
            policy.push_str(&headers::policy_value(&limit.limit));
            ratelimit.push_str(", ");
            ratelimit.push_str(&headers::ratelimit_value(limit.limit.name(), &limit.quota));
        }
        let ascii = "plan and limit names are [A-Za-z0-9_-]";
        let policy = HeaderValue::try_from(policy).expect(ascii);
        headers.insert(headers::RATELIMIT_POLICY, policy);
        let ratelimit = HeaderValue::try_from(ratelimit).expect(ascii);
        headers.insert(headers::RATELIMIT, ratelimit);
    }
    let binding = match decision.refused_by {
        Some(index) => Some(&decision.route_limits[index]),
        // The plan refused: its fields, as the `Retry-After` and the problem's detail say. A
        // route limit with less left showed instead, its reset before the `Retry-After`.
        None if decision.outcome.refuses() => None,
        None => decision
            .route_limits
            .iter()
            .filter(|l| l.quota.remaining < decision.quota.remaining)
            .min_by_key(|l| l.quota.remaining),
    };
    if let Some(limit) = binding {
        let single = HeaderStyles {
            ietf: false,
            ..fields.styles
        };
        let policy = HeaderValue::from_static("");
        headers::insert(
            headers,
            single,
            limit.limit.name(),
            policy,
            &limit.quota,
            None,
        );
    }
}

/// A request refused a concurrency slot (of `slots` in flight at once): the fields name that
/// limit beside the rate's, spent for a second. Before, a slot's 429 showed the rate's quota
/// alone, with units left (`r=4`, `X-RateLimit-Remaining: 4`), and a client that reads what
/// is left retried at once. The IETF fields list it as the draft's `concurrent-requests`
/// quota unit; the single-valued styles show it, as the limit that binds.
pub fn add_slot_refusal(headers: &mut HeaderMap, fields: &Fields, slots: u64) {
    let name = crate::http::concurrency::CONCURRENCY_LIMIT_NAME;
    if fields.styles.ietf {
        let policy = format!("\"{name}\";q={slots};qu=\"concurrent-requests\"");
        append_item(headers, headers::RATELIMIT_POLICY, &policy);
        append_item(headers, headers::RATELIMIT, &format!("\"{name}\";r=0;t=1"));
    }
    let single = HeaderStyles {
        ietf: false,
        ..fields.styles
    };
    let quota = Quota {
        limit: slots,
        window_seconds: 0,
        remaining: 0,
        reset_seconds: 1,
    };
    let policy = HeaderValue::from_static("");
    headers::insert(headers, single, name, policy, &quota, Some(1));
}

/// Appends `item` to the list field `name` (or sets it).
fn append_item(headers: &mut HeaderMap, name: actix_web::http::header::HeaderName, item: &str) {
    let value = match headers.get(&name).and_then(|v| v.to_str().ok()) {
        Some(list) if !list.is_empty() => format!("{list}, {item}"),
        _ => item.to_owned(),
    };
    let value = HeaderValue::try_from(value).expect("list items are visible ASCII");
    headers.insert(name, value);
}

/// The answer to a request the limiter refuses: 429 when the caller is out of credit, 403 while
/// an operator blocks it, 503 when the ledger could not decide and the policy is closed. `None` when the request goes on.
pub fn refusal(decision: &Decision<'_>, fields: &Fields) -> Option<HttpResponse> {
    let (mut response, retry_after_seconds) = match &decision.outcome {
        Outcome::Admitted | Outcome::FailedOpen(_) => return None,
        Outcome::Limited {
            retry_after_seconds,
            source,
        } => {
            span::limited_event(*retry_after_seconds, source.as_str());
            let (what, name, quota) = match decision.refused_by {
                Some(index) => {
                    let limit = &decision.route_limits[index];
                    (Refuser::Limit, limit.limit.name(), &limit.quota)
                }
                None => (Refuser::Plan, decision.plan.name(), &decision.quota),
            };
            let retry = *retry_after_seconds;
            let body = repeats::rate_limited_body(what, name, quota, retry, || {
                let detail = format!(
                    "{} {name} allows {} units per {} s; retry after {retry} s",
                    what.as_str(),
                    quota.limit,
                    quota.window_seconds
                );
                problem::body_bytes(ProblemKind::RateLimited, &detail)
            });
            let response = problem::with_body(ProblemKind::RateLimited.status(), body);
            (response, retry)
        }
        Outcome::Blocked {
            retry_after_seconds,
            ..
        } => {
            let detail =
                format!("an operator blocked this caller; retry after {retry_after_seconds} s");
            let response = problem::response(ProblemKind::Blocked, &detail);
            (response, *retry_after_seconds)
        }
        Outcome::FailedClosed(error) => {
            let detail = format!(
                "the rate limiter could not decide in time ({})",
                error.kind().as_str()
            );
            // Worth retrying soon: the ledger, not the caller's credit, is the problem.
            (
                problem::response(ProblemKind::LedgerUnavailable, &detail),
                1,
            )
        }
    };
    add_fields(
        response.headers_mut(),
        fields,
        decision,
        Some(retry_after_seconds),
    );
    Some(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The single-valued styles show the limit that binds: on a refusal by the plan, the plan,
    /// even beside a route limit with less left.
    #[test]
    fn a_refusal_by_the_plan_binds_the_single_valued_fields_to_it() {
        use crate::limiter::extra::RouteLimitStatus;
        use crate::limiter::plan::{PlanBook, UnknownKeys};
        use crate::limiter::DecisionSource;
        let plan = |name, capacity| {
            let capacity = std::num::NonZeroU64::new(capacity).unwrap();
            Plan::new(name, capacity, std::num::NonZeroU32::new(30).unwrap()).unwrap()
        };
        let (none, keys) = (
            Vec::<(String, String)>::new(),
            Vec::<(String, String)>::new(),
        );
        let book = PlanBook::new(
            vec![plan("free", 5)],
            "free",
            none,
            keys,
            UnknownKeys::Reject,
        );
        let book = book.unwrap();
        let fields = Fields {
            policies: PolicyHeaders::new(&book),
            styles: HeaderStyles {
                ietf: false,
                github: true,
                bucket4j: false,
            },
        };
        let quota = |limit, remaining, reset_seconds| Quota {
            limit,
            window_seconds: 30,
            remaining,
            reset_seconds,
        };
        let mut decision = Decision {
            outcome: Outcome::Admitted,
            plan: &book.plans()[0],
            plan_id: book.default_plan(),
            account_id: 1,
            quota: quota(5, 2, 20),
            hold: None,
            leased: None,
            route_limits: vec![RouteLimitStatus {
                limit: plan("per_day", 100),
                account_id: 2,
                quota: quota(100, 1, 5),
                hold: None,
            }],
            refused_by: None,
        };
        let limit_shown = |decision: &Decision<'_>| {
            let mut headers = HeaderMap::new();
            add_fields(&mut headers, &fields, decision, None);
            let shown = headers.get("x-ratelimit-limit").expect("github style");
            shown.to_str().unwrap().to_owned()
        };
        assert_eq!(
            limit_shown(&decision),
            "100",
            "admitted: the least left binds"
        );
        decision.outcome = Outcome::Limited {
            retry_after_seconds: 20,
            source: DecisionSource::Ledger,
        };
        assert_eq!(limit_shown(&decision), "5", "the plan refused");
    }

    #[test]
    fn reported_costs_are_digits_up_to_the_bound() {
        let cost = |v: &str| reported_cost(&HeaderValue::from_str(v).unwrap());
        assert_eq!(cost("0"), Some(0));
        assert_eq!(cost("1099511627776"), Some(REPORTED_COST_MAX));
        assert_eq!(cost("1099511627777"), None);
        for bad in ["", "-1", "1.5", " 3", "3 ", "0x10", "99999999999999999999"] {
            assert_eq!(cost(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn key_errors_map_to_statuses_and_a_401_says_how_to_present_a_key() {
        let header = "x-api-key".to_owned();
        let missing = StatusCode::UNAUTHORIZED;
        let challenge = HeaderValue::from_static("ApiKey header=\"x-api-key\"");
        let rejected = |error: &KeyError, missing| rejected(error, missing, Some(&challenge));
        let asks = |response: &HttpResponse| {
            let found = response
                .headers()
                .get(actix_web::http::header::WWW_AUTHENTICATE);
            found.map(|value| value.to_str().unwrap().to_owned())
        };
        let unknown = rejected(&KeyError::Unknown, missing);
        assert_eq!(unknown.status(), 401);
        assert_eq!(
            asks(&unknown).as_deref(),
            Some("ApiKey header=\"x-api-key\"")
        );
        // No address: with a key to send, a 401 asking for it; by address alone, the server's
        // fault.
        assert_eq!(rejected(&KeyError::NoPeerAddress, missing).status(), 401);
        let by_address = super::rejected(&KeyError::NoPeerAddress, missing, None);
        assert_eq!(by_address.status(), 500);
        assert_eq!(asks(&by_address), None);
        let no_key = KeyError::Missing {
            header: header.clone(),
        };
        let missing_401 = rejected(&no_key, missing);
        assert_eq!(missing_401.status(), 401);
        assert!(asks(&missing_401).is_some());
        let missing_400 = rejected(&no_key, StatusCode::BAD_REQUEST);
        assert_eq!(
            (missing_400.status().as_u16(), asks(&missing_400)),
            (400, None)
        );
        let repeated = rejected(&KeyError::Repeated { header }, missing);
        assert_eq!((repeated.status().as_u16(), asks(&repeated)), (400, None));
    }
}
