//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit` on the limiter's decision core.
//!
//! Each descriptor of a request is matched to a rule ([`RlsConfig::rule_for`]), and each counted
//! one becomes a [`Limit`] on an account of its own: one per (domain, rule, the descriptor's
//! entries, limit, window), derived as the middleware derives callers' accounts. All enforced
//! limits of a request are one linked chain ([`Limiter::check_all`]): a denied request consumes
//! nothing on any descriptor. `shadow_mode` rules are decided (each alone) and counted, never deny.
//! `is_negative_hits` gives live holds back ([`Ledger::release_units`]), never below zero.
//!
//! Bad input is `INVALID_ARGUMENT`; a ledger that cannot decide within the deadline is
//! `UNAVAILABLE` under the closed failure policy (Envoy then applies its `failure_mode_deny`), and
//! OK under the open one. Descriptor values can be secrets (API keys): they are hashed into account
//! ids and never logged, counted or traced.

use std::num::{NonZeroU32, NonZeroU64};
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use futures_util::future::join_all;
use tonic::{Request, Response, Status};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::config::{RlsConfig, Rule, RuleLimit, Unit, DEPTH_MAX, KEY_VALUE_LENGTH_MAX};
use super::metrics::RlsMetrics;
use super::rules::LiveRules;
use crate::ledger::model::{self, UserAccount};
use crate::ledger::Ledger;
use crate::ledger::{HoldReply, LedgerError};
use crate::limiter::multi::cost_on_account;
use crate::limiter::{
    FailurePolicy, KnownFree, Limit, Limiter, MultiDecision, Outcome, LIMITS_PER_CHECK_MAX,
};

/// At most this many descriptors per request (each is one link of the ledger chain).
pub const DESCRIPTORS_MAX: usize = LIMITS_PER_CHECK_MAX;
/// A request's `hits_addend` above this counts as this many: more than any limit (a rule's is a
/// 32-bit `requests_per_unit`), so it is over the limit, as a larger one is, without filling the
/// ledger's 64-bit amounts.
pub const HITS_MAX: u64 = 1 << 32;

/// What one descriptor of a request came to before any ledger call.
#[derive(Debug, Clone)]
enum Matched {
    /// No rule (or a rule another one `replaces`): OK, no limit.
    Nothing,
    /// An `unlimited` rule (its `replaces` still apply, as envoyproxy/ratelimit's do).
    Unlimited { rule: Arc<Rule> },
    Counted {
        rule: Arc<Rule>,
        /// Its cost is the hits, or 0 for a negative hit (which holds nothing).
        limit: Limit,
        unit: Option<Unit>,
        /// `is_negative_hits` with hits above 0: give `hits` units back.
        negative: bool,
        hits: u64,
    },
}

/// The RLS front end: shares the HTTP front end's limiter (one ledger client, one local view).
/// The wall-clock second a failed release was last logged in ([`crate::telemetry::log_throttle`]).
static RELEASE_FAILURE_LOGGED_SECOND: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(0);

/// The wall-clock second a call past `rls.calls_max` was last logged in.
static SHED_LOGGED_SECOND: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

pub struct RateLimitServer {
    limiter: Arc<Limiter>,
    rules: Arc<LiveRules>,
    metrics: RlsMetrics,
}

impl RateLimitServer {
    pub fn new(limiter: Arc<Limiter>, rules: Arc<LiveRules>) -> Self {
        RateLimitServer {
            limiter,
            rules,
            metrics: RlsMetrics::register(),
        }
    }

    fn ledger(&self) -> &Ledger {
        self.limiter.ledger()
    }

    /// Checks the request's bounds and matches every descriptor: no ledger call.
    fn matched(&self, request: &RateLimitRequest) -> Result<Vec<Matched>, Status> {
        if request.domain.is_empty() {
            return Err(Status::invalid_argument(
                "rate limit domain must not be empty",
            ));
        }
        if request.descriptors.is_empty() {
            return Err(Status::invalid_argument(
                "rate limit descriptor list must not be empty",
            ));
        }
        if request.descriptors.len() > DESCRIPTORS_MAX {
            return Err(Status::invalid_argument(format!(
                "at most {DESCRIPTORS_MAX} descriptors per request"
            )));
        }
        if request.domain.len() > KEY_VALUE_LENGTH_MAX {
            return Err(Status::invalid_argument("domain too long"));
        }
        let hits = match request.hits_addend {
            0 => 1,
            hits => u64::from(hits),
        };
        let ledger_id = self.ledger().ledger_id();
        // The rules in force when the call came: every descriptor under the same ones.
        let config = self.rules.current();
        let mut matched: Vec<Matched> = (request.descriptors.iter())
            .map(|descriptor| {
                match_descriptor(&config, ledger_id, &request.domain, descriptor, hits)
            })
            .collect();
        apply_replaces(&mut matched);
        Ok(matched)
    }
}

/// What a look-up of a descriptor found ([`descriptor_account`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DescriptorAccount {
    /// Past a call's bounds (a call with it would match no rule): why.
    Invalid(String),
    /// No rule matches it: Envoy's calls are `OK` with no limit, and no account is kept.
    NoRule,
    /// An `unlimited` rule (named as in metrics: its `name`, else its label): no account either.
    Unlimited { rule: String },
    /// A counted rule's account, where its calls are charged.
    Counted {
        rule: String,
        account: UserAccount,
        shadow_mode: bool,
    },
}

/// The account Envoy's calls with the descriptor `entries` (key, value) in `domain` are charged
/// to, matched as a call matches it, so that an operator can inspect, top up, reduce or block it
/// as any caller's (the admin API's `/admin/envoy/lookup`). No ledger call. A request's own
/// `limit` override is not looked up: its accounts are the request's alone.
pub fn descriptor_account(
    config: &RlsConfig,
    ledger_id: u32,
    domain: &str,
    entries: Vec<(String, String)>,
) -> DescriptorAccount {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    // As a call's text is decoded (`wire::text`), whose accounts derive from it: a U+FFFD is
    // doubled there, and a value with one was looked up as an account no call is charged to.
    let text = |text: String| super::wire::text(text.into_bytes());
    let domain = &text(domain.to_owned());
    let entries: Vec<(String, String)> = (entries.into_iter())
        .map(|(key, value)| (text(key), text(value)))
        .collect();
    if domain.is_empty() || domain.len() > KEY_VALUE_LENGTH_MAX {
        let detail = format!("a domain is 1 to {KEY_VALUE_LENGTH_MAX} bytes");
        return DescriptorAccount::Invalid(detail);
    }
    if !(1..=DEPTH_MAX).contains(&entries.len()) {
        let detail = format!("a descriptor has 1 to {DEPTH_MAX} entries");
        return DescriptorAccount::Invalid(detail);
    }
    if (entries.iter()).any(|(key, _)| key.is_empty() || key.len() > KEY_VALUE_LENGTH_MAX) {
        let detail = format!("an entry's key is 1 to {KEY_VALUE_LENGTH_MAX} bytes");
        return DescriptorAccount::Invalid(detail);
    }
    let descriptor = RateLimitDescriptor {
        entries: (entries.into_iter())
            .map(|(key, value)| Entry { key, value })
            .collect(),
        ..RateLimitDescriptor::default()
    };
    match match_descriptor(config, ledger_id, domain, &descriptor, 1) {
        Matched::Nothing => DescriptorAccount::NoRule,
        Matched::Unlimited { rule } => DescriptorAccount::Unlimited {
            rule: super::metrics::label(&rule),
        },
        Matched::Counted { rule, limit, .. } => DescriptorAccount::Counted {
            rule: super::metrics::label(&rule),
            account: limit.account,
            shadow_mode: rule.shadow_mode,
        },
    }
}

/// Matches one descriptor to its rule and account, as [`RateLimitServer::matched`] does for
/// each of a request's.
fn match_descriptor(
    config: &RlsConfig,
    ledger_id: u32,
    domain: &str,
    descriptor: &RateLimitDescriptor,
    request_hits: u64,
) -> Matched {
    if !matchable(descriptor) {
        return Matched::Nothing;
    }
    let hits = descriptor
        .hits_addend
        .map_or(request_hits, |h| h.value)
        .min(HITS_MAX);
    let entries = descriptor
        .entries
        .iter()
        .map(|e| (e.key.as_str(), e.value.as_str()));
    // As envoyproxy/ratelimit: a request's own limit applies in any configured domain, a
    // configured rule otherwise.
    let overridden = descriptor
        .limit
        .filter(|_| config.has_domain(domain))
        .and_then(|limit| override_rule(domain, limit.requests_per_unit, limit.unit));
    let rule = match overridden {
        Some(rule) => rule,
        None => match config.rule_for(domain, entries) {
            Some(rule) => rule,
            None => return Matched::Nothing,
        },
    };
    let (requests_per_unit, window_seconds, unit) = match rule.limit {
        RuleLimit::Unlimited => return Matched::Unlimited { rule },
        RuleLimit::Counted {
            requests_per_unit,
            window_seconds,
            unit,
        } => (requests_per_unit, window_seconds, unit),
    };
    let account = UserAccount {
        id: account_id(
            ledger_id,
            domain,
            &rule,
            descriptor,
            window_seconds,
            requests_per_unit,
        ),
        capacity: requests_per_unit,
        window_seconds,
    };
    let negative = descriptor.is_negative_hits;
    let limit = Limit {
        account,
        cost: if negative { 0 } else { hits },
        local_view: !rule.concurrency,
        lease: None,
    };
    Matched::Counted {
        rule,
        limit,
        unit,
        negative,
        hits,
    }
}

/// Whether any rule could match `descriptor`: one with no entries, more than any rule's depth,
/// or a key longer than any rule's is no limit (`OK`), as envoyproxy/ratelimit answers it.
///
/// Never an error for the whole request. Why: Envoy lets a request through when its rate-limit
/// call fails (`failure_mode_deny: false`, its default), so an error that a client could provoke
/// (a 300-byte API key in a descriptor's value once was one) skipped every limit of the request.
/// A value's length is never judged: values only select among a rule's and are hashed into an
/// account's id, and the request's size is bounded by the gRPC message limit.
fn matchable(descriptor: &RateLimitDescriptor) -> bool {
    let depth = descriptor.entries.len();
    (1..=DEPTH_MAX).contains(&depth)
        && descriptor
            .entries
            .iter()
            .all(|e| e.key.len() <= KEY_VALUE_LENGTH_MAX)
}

/// A request's own limit (`RateLimitDescriptor.limit`), as envoyproxy/ratelimit applies it: never
/// in shadow mode. Its accounts are apart from any configured rule's: its path has a `/`, which
/// no configured rule's has (a configured key `override` is `<domain>.override`).
///
/// `None` for an override this service cannot apply (0 requests per unit, or no unit): the
/// configured rule applies instead. Why not an error: Envoy lets a request whose call failed
/// through (`failure_mode_deny: false`), every other limit of it skipped.
fn override_rule(domain: &str, requests_per_unit: u32, unit: i32) -> Option<Arc<Rule>> {
    let unit = Unit::from_proto(unit);
    let requests_per_unit = NonZeroU64::new(requests_per_unit.into());
    let (Some(unit), Some(requests_per_unit)) = (unit, requests_per_unit) else {
        tracing::debug!(
            domain,
            "a limit override without a unit or of 0 requests is not applied"
        );
        return None;
    };
    // A configured domain's (overrides apply in those only): bounded, as a label.
    let path: Arc<str> = format!("{domain}/override").into();
    Some(Arc::new(Rule {
        label: path.clone(),
        path,
        name: None,
        limit: RuleLimit::Counted {
            requests_per_unit,
            window_seconds: NonZeroU32::new(unit.seconds()).expect("units are not empty"),
            unit: Some(unit),
        },
        replaces: Vec::new(),
        shadow_mode: false,
        detailed_metric: false,
        concurrency: false,
    }))
}

/// The account of one descriptor on one rule: the rule, its limit and window, and every entry of
/// the descriptor are its identity (so each value of a key-only rule counts apart).
fn account_id(
    ledger_id: u32,
    domain: &str,
    rule: &Rule,
    descriptor: &RateLimitDescriptor,
    window_seconds: NonZeroU32,
    capacity: NonZeroU64,
) -> u128 {
    let mut identity = Vec::with_capacity(256);
    for part in [domain.as_bytes(), &window_seconds.get().to_le_bytes()] {
        identity.extend_from_slice(&(part.len() as u64).to_le_bytes());
        identity.extend_from_slice(part);
    }
    for entry in &descriptor.entries {
        for part in [entry.key.as_bytes(), entry.value.as_bytes()] {
            identity.extend_from_slice(&(part.len() as u64).to_le_bytes());
            identity.extend_from_slice(part);
        }
    }
    let plan = format!("envoy/{}", rule.path);
    model::user_account_id(ledger_id, &plan, capacity, &identity)
}

/// A rule named in another matched rule's `replaces` does not apply (envoyproxy/ratelimit).
fn apply_replaces(matched: &mut [Matched]) {
    let replaced: Vec<String> = matched
        .iter()
        .filter_map(|m| match m {
            Matched::Counted { rule, .. } | Matched::Unlimited { rule } => {
                Some(rule.replaces.clone())
            }
            Matched::Nothing => None,
        })
        .flatten()
        .collect();
    for m in matched.iter_mut() {
        if let Matched::Counted { rule, .. } = m {
            if rule.name.as_ref().is_some_and(|n| replaced.contains(n)) {
                *m = Matched::Nothing;
            }
        }
    }
}

/// What the ledger said of each kind of descriptor.
struct Decided {
    /// The enforced limits' decision, with the descriptor index of each of its limits.
    enforced: (Vec<usize>, MultiDecision),
    /// Each shadow descriptor's own decision.
    shadow: Vec<(usize, MultiDecision)>,
    /// Each negative-hits descriptor's available credit after the release (`None`: unknown).
    released: Vec<(usize, Option<u64>)>,
}

/// The counted descriptors of `matched`, by kind, each with its index: enforced (indices, and
/// limits), in shadow mode, and negative hits (with their hits).
#[allow(clippy::type_complexity)]
fn by_kind(
    matched: &[Matched],
) -> (
    (Vec<usize>, Vec<Limit>),
    Vec<(usize, Limit)>,
    Vec<(usize, Limit, u64)>,
) {
    let mut enforced = (Vec::new(), Vec::new());
    let mut shadow = Vec::new();
    let mut negative = Vec::new();
    for (index, m) in matched.iter().enumerate() {
        if let Matched::Counted {
            rule,
            limit,
            negative: n,
            hits,
            ..
        } = m
        {
            if *n {
                // A negative hit of nothing gives back nothing, reads nothing, and claims
                // nothing (its status stays plain).
                if *hits > 0 {
                    negative.push((index, *limit, *hits));
                }
            } else if rule.shadow_mode {
                shadow.push((index, *limit));
            } else {
                enforced.0.push(index);
                enforced.1.push(*limit);
            }
        }
    }
    (enforced, shadow, negative)
}

impl RateLimitServer {
    /// The answer to a call past `rls.calls_max`, not decided: `UNAVAILABLE` under the closed
    /// failure policy, `OK` under the open one, as for a ledger that cannot decide in time.
    pub fn shed(&self) -> Result<Response<RateLimitResponse>, Status> {
        self.metrics.record_shed();
        if crate::telemetry::log_throttle(&SHED_LOGGED_SECOND) {
            tracing::warn!(
                "the Envoy front end has rls.calls_max calls in flight; more are not decided"
            );
        }
        match self.limiter.settings().failure_policy {
            FailurePolicy::Closed => Err(Status::unavailable(
                "too many calls in flight (rls.calls_max): not decided",
            )),
            FailurePolicy::Open => Ok(Response::new(RateLimitResponse {
                overall_code: Code::Ok as i32,
                ..RateLimitResponse::default()
            })),
        }
    }

    /// The deadline of one call's decision (`ledger.timeout_ms`).
    pub fn decision_timeout(&self) -> std::time::Duration {
        self.limiter.settings().ledger_timeout
    }

    /// The call's deadline: the decision's (`ledger.timeout_ms`), or sooner when Envoy gives up
    /// sooner (`grpc-timeout`; Envoy's default is 20 ms). Decided by then, the failure policy
    /// configured here answers; past it, tonic dropped the call (`CANCELLED`, counted nowhere)
    /// and Envoy applied its own `failure_mode_deny` instead, whatever the policy here said.
    fn call_deadline(&self, metadata: &tonic::metadata::MetadataMap) -> Instant {
        let ledger = self.limiter.deadline();
        let envoys = metadata.get("grpc-timeout").and_then(|value| {
            let timeout = grpc_timeout(value.as_bytes())?;
            // The answer's way back to Envoy.
            let margin = (timeout / 5).min(ANSWER_MARGIN_MAX);
            Instant::now().checked_add(timeout - margin)
        });
        envoys.map_or(ledger, |envoys| envoys.min(ledger))
    }

    async fn decide(&self, matched: &[Matched], deadline: Instant) -> Result<Decided, Status> {
        let (enforced, shadow, negative) = by_kind(matched);
        let shadows = join_all(shadow.iter().map(|(_, limit)| {
            self.limiter
                .check_all_by(std::slice::from_ref(limit), deadline)
        }));
        let releases = join_all(
            negative
                .iter()
                .map(|(_, limit, hits)| self.release(limit, *hits, deadline)),
        );
        let unknown = self.limiter.unknown_limits(&enforced.1);
        let checked = self.limiter.check_all_by(&enforced.1, deadline);
        let (decision, shadows, releases) = futures_util::join!(checked, shadows, releases);
        let internal = |e: crate::limiter::LimitsError| Status::internal(e.to_string());
        let mut decision = decision.map_err(internal)?;
        // limit_remaining is the ledger's, not a guess, even right after a restart.
        self.limiter
            .learn(&enforced.1, &unknown, &mut decision, deadline)
            .await;
        self.hold_what_remains(&enforced.1, &mut decision, deadline)
            .await;
        let mut shadows = shadows
            .into_iter()
            .collect::<Result<Vec<_>, _>>()
            .map_err(internal)?;
        match decision.outcome {
            Outcome::Admitted | Outcome::FailedOpen(_) => {
                self.over_charge_shadows(&shadow, &mut shadows, deadline)
                    .await;
            }
            _ => self.void_shadow_holds(&shadow, &shadows),
        }
        let shadow = shadow
            .iter()
            .map(|(index, _)| *index)
            .zip(shadows)
            .collect();
        let released = negative.iter().map(|(i, _, _)| *i).zip(releases).collect();
        Ok(Decided {
            enforced: (enforced.0, decision),
            shadow,
            released,
        })
    }

    /// A charge of more than one unit refused for want of credit is counted as far as it goes:
    /// what its account has left is held for the window, so the descriptor is spent, as
    /// envoyproxy/ratelimit's counter is then over its limit. Without it, a charge reported
    /// after the response (`apply_on_stream_done`, tokens counted at the end) that did not fit
    /// was dropped, the budget never ran out, and checks (`hits_addend` 0) passed for good. One
    /// more write, on a refusal that left something free only; best effort, by the decision's
    /// `deadline`. It holds at most the charge less one (a refusal is never charged in full),
    /// and the refusal then says when the charge fits with that hold counted. The call's other
    /// descriptors are charged as far as they go too ([`RateLimitServer::over_charge_the_rest`]).
    async fn hold_what_remains(
        &self,
        limits: &[Limit],
        decision: &mut MultiDecision,
        deadline: std::time::Instant,
    ) {
        let (Outcome::Limited { .. }, Some(refused)) = (&decision.outcome, decision.refused_by)
        else {
            return;
        };
        let rest = self.over_charge_the_rest(limits, refused, deadline);
        let refused_one = self.over_charge_refused(limits, refused, decision, deadline);
        let ((), charged) = futures_util::join!(refused_one, rest);
        for (limit, status) in limits.iter().zip(&mut decision.limits) {
            if let Some((_, charge)) = charged.iter().find(|(id, _)| *id == limit.account.id) {
                status.quota.remaining = status.quota.remaining.saturating_sub(*charge);
            }
        }
    }

    /// [`RateLimitServer::hold_what_remains`] on the descriptor that refused (`limits[refused]`).
    async fn over_charge_refused(
        &self,
        limits: &[Limit],
        refused: usize,
        decision: &mut MultiDecision,
        deadline: std::time::Instant,
    ) {
        let limit = &limits[refused];
        let charge = cost_on_account(limits, limit.account.id);
        // A charge of 1 refused has nothing left to hold. A concurrency rule's holds are slots
        // that negative hits give back one request at a time: one that spent the rest would
        // hold them all until its window ended.
        if charge <= 1 || !limit.local_view {
            return;
        }
        let known = self.limiter.known_free(limit.account.id);
        // Nothing free, as the listing of this refusal (or the view that refused) says: a hold
        // of 0 would be a write for nothing.
        if known == KnownFree::Listed(0) {
            return;
        }
        let window = limit.account.window_seconds.get();
        let held = self
            .ledger()
            .hold_what_remains(limit.account.id, charge, window, deadline)
            .await;
        let retry = self.retry_after_over_charge(&limit.account, charge, known, held);
        if let (
            Some(seconds),
            Outcome::Limited {
                retry_after_seconds,
                ..
            },
        ) = (retry, &mut decision.outcome)
        {
            *retry_after_seconds = (*retry_after_seconds).max(seconds);
        }
        // Every descriptor on that account: a descriptor named twice is spent twice over.
        for (limit, status) in limits.iter().zip(&mut decision.limits) {
            if limit.account.id == limits[refused].account.id {
                status.quota.remaining = 0;
            }
        }
    }

    /// The call's other descriptors, when a charge of more than one unit was refused for want of
    /// credit: each account is charged too, as far as it goes (the charge, or what it has left
    /// if less), for its window, as envoyproxy/ratelimit adds the hits to every descriptor of
    /// the call. Without it, a charge reported after the response (tokens counted at the end)
    /// that one budget refused was counted on none of the others: a client that overran the
    /// minute's budget once a minute was never counted on the day's. Concurrency rules and
    /// checks (`hits_addend` 0) hold nothing, nor an account not made yet (a caller's first
    /// call, refused before its chain made it). Best effort, by `deadline`, all at once. What
    /// was held: each account and its charge (the most it can have held).
    async fn over_charge_the_rest(
        &self,
        limits: &[Limit],
        refused: usize,
        deadline: std::time::Instant,
    ) -> Vec<(u128, u64)> {
        let refused_id = limits[refused].account.id;
        // A charge of 1 refused is a request refused: nothing anywhere, as the chain left it.
        if cost_on_account(limits, refused_id) <= 1 {
            return Vec::new();
        }
        let rest = (0..limits.len()).filter(|&i| {
            let id = limits[i].account.id;
            let first = limits[..i].iter().all(|l| l.account.id != id);
            first && id != refused_id && limits[i].local_view && limits[i].cost > 0
        });
        let holds = rest.map(|i| async move {
            let account = &limits[i].account;
            let charge = cost_on_account(limits, account.id);
            let window = account.window_seconds.get();
            let held = (self.ledger())
                .hold_up_to(account.id, charge, window, deadline)
                .await;
            // The view does not count it (what was held is unknown to it): listed anew.
            match held {
                Ok(HoldReply::Held { .. }) => {
                    self.limiter.forget(account.id);
                    Some((account.id, charge))
                }
                Ok(_) => None,
                Err(error) => {
                    tracing::debug!(%error, "could not charge a refused call's other descriptor");
                    self.limiter.forget(account.id);
                    None
                }
            }
        });
        join_all(holds).await.into_iter().flatten().collect()
    }

    /// When a charge refused and over-charged fits again, if later than the refusal said; and
    /// what this instance remembers of the account after it. What was free is held for a window
    /// now, so the charge fits only once older holds have freed all of it, not just what was
    /// missing: a client told the latter and retrying then would be refused again, its
    /// over-charge spending what came back, for as long as it obeyed.
    fn retry_after_over_charge(
        &self,
        account: &UserAccount,
        charge: u64,
        known: KnownFree,
        held: Result<HoldReply, LedgerError>,
    ) -> Option<u64> {
        let window = self
            .limiter
            .seconds_until_expired(account.window_seconds.get());
        let held = match held {
            Ok(HoldReply::Held { .. }) => true,
            // Closed meanwhile (a block, a move: the refusal says so): nothing was held.
            Ok(_) => {
                self.limiter.forget(account.id);
                return None;
            }
            Err(error) => {
                tracing::debug!(%error, "could not hold what was left of a refused charge");
                false
            }
        };
        let retry = match known {
            // When the charge fits with the most the over-charge can have held (the view's
            // free credit may be short of the ledger's, by holds expired since it was listed).
            KnownFree::Listed(_) if held => {
                let fits =
                    (self.limiter).seconds_until_fits_after_hold(account, charge - 1, charge);
                fits.map_or(window, |seconds| seconds.clamp(1, window))
            }
            // Its oldest holds are not listed: when they come back is unknown, so the window;
            // the view stays, and with it the listing's stand-in (the next refusal lists nothing).
            KnownFree::ListedIncomplete if held => return Some(window),
            // Held an unknown amount; or unanswered, and it may land: all of it is free once
            // this hold has expired.
            _ => window,
        };
        // The view does not count the over-charge (the ledger held what was free, unknown to
        // it): the next refusal lists the account, and the ones after it are refused from memory.
        self.limiter.forget(account.id);
        Some(retry)
    }

    /// A shadow descriptor the request's charge did not fit spends what remains, as it would
    /// enforced ([`RateLimitServer::hold_what_remains`]), on a request the enforced descriptors
    /// admitted: shadow mode then predicts what enforcing would refuse next (envoyproxy's shadow
    /// counter goes past its limit too). Without it, a charge of several hits refused in shadow
    /// spent nothing, and the next charge of one passed where enforced it would be refused.
    async fn over_charge_shadows(
        &self,
        shadow: &[(usize, Limit)],
        decided: &mut [MultiDecision],
        deadline: std::time::Instant,
    ) {
        let over = (shadow.iter().zip(decided.iter_mut())).map(|((_, limit), decision)| {
            self.hold_what_remains(std::slice::from_ref(limit), decision, deadline)
        });
        join_all(over).await;
    }

    /// Voids what shadow descriptors held for a request the enforced ones refused: it consumes
    /// nothing on any descriptor, as it would if those rules were enforced (their holds are
    /// placed beside the enforced chain, not after it, to cost no second round trip). In a task
    /// of its own, with a deadline of its own: the answer does not wait for it (a slow ledger's
    /// answer waited twice), and a refusal that spent the decision's deadline (failed closed)
    /// still gets its voids sent. Best effort: a hold not voided expires with its window.
    fn void_shadow_holds(&self, shadow: &[(usize, Limit)], decided: &[MultiDecision]) {
        let holds: Vec<_> = (shadow.iter().zip(decided))
            .filter_map(|((_, limit), decision)| {
                let hold = decision.limits.first()?.hold?;
                Some((limit.account.id, hold))
            })
            .collect();
        if holds.is_empty() {
            return;
        }
        let limiter = self.limiter.clone();
        tokio::spawn(async move {
            let deadline = limiter.deadline();
            let voids = (holds.into_iter())
                .map(|(account_id, hold)| limiter.release_by(account_id, hold, deadline));
            for result in join_all(voids).await {
                if let Err(error) = result {
                    tracing::debug!(%error, "could not void a shadow hold; it expires with its window");
                }
            }
        });
    }

    /// Gives back `hits` units of live holds (a negative hit). A ledger that fails here changes
    /// nothing: the holds expire by themselves after their window.
    async fn release(&self, limit: &Limit, hits: u64, deadline: Instant) -> Option<u64> {
        // Nothing to give back (a refund of what was all used): no call, and no check either. As
        // a check it could refuse, and refuse the call's other descriptors their charges.
        if hits == 0 {
            return None;
        }
        let window = limit.account.window_seconds.get();
        let released = self
            .ledger()
            .release_units(limit.account.id, hits, window, deadline)
            .await;
        // This instance's memory of the holds is stale now, failed or not (a failure may come
        // after some voids landed: a local 429 on holds given back would be wrong); the next
        // request asks. (A limit it keeps no memory of, a concurrency rule's, has nothing to
        // forget: and a forget keeps its shard's listings in flight from being remembered.)
        if limit.local_view {
            self.limiter.forget(limit.account.id);
        }
        match released {
            Ok(released) => {
                self.metrics.record_release(released.units);
                released.available
            }
            Err(error) => {
                // On the span always; in the log at most once a second: an outage fails every one.
                tracing::warn!(target: crate::telemetry::SPAN_EVENTS_TARGET, %error, "could not release a negative hit");
                if crate::telemetry::log_throttle(&RELEASE_FAILURE_LOGGED_SECOND) {
                    tracing::warn!(%error, "could not release a negative hit; its holds will expire (logged at most once a second)");
                }
                None
            }
        }
    }
}

/// A gRPC call's metadata read as W3C trace context (`traceparent`, `tracestate`).
struct MetadataCarrier<'a>(&'a tonic::metadata::MetadataMap);

impl opentelemetry::propagation::Extractor for MetadataCarrier<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|value| value.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        let keys = self.0.keys().filter_map(|key| match key {
            tonic::metadata::KeyRef::Ascii(key) => Some(key.as_str()),
            tonic::metadata::KeyRef::Binary(_) => None,
        });
        keys.collect()
    }
}

#[tonic::async_trait]
impl RateLimitService for RateLimitServer {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let deadline = self.call_deadline(request.metadata());
        // Envoy sends its request's trace context: this span is that request's child, in its
        // trace (each call was a trace of its own, apart from the request it decided).
        let parent = opentelemetry::global::get_text_map_propagator(|propagator| {
            propagator.extract(&MetadataCarrier(request.metadata()))
        });
        let request = request.into_inner();
        // The domain is configuration, never a secret; descriptor values can be (API keys). A
        // domain over the bound is refused below, and not copied into the span first.
        let domain = match request.domain.len() <= KEY_VALUE_LENGTH_MAX {
            true => request.domain.as_str(),
            false => "(too long)",
        };
        let span = tracing::info_span!(
            "ShouldRateLimit",
            otel.kind = "server",
            rpc.system = "grpc",
            rpc.service = "envoy.service.ratelimit.v3.RateLimitService",
            rpc.method = "ShouldRateLimit",
            ratelimit.frontend = super::metrics::FRONTEND,
            ratelimit.domain = %domain,
            ratelimit.descriptors = request.descriptors.len(),
            ratelimit.overall_code = tracing::field::Empty,
            rpc.grpc.status_code = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
        );
        let _ = span.set_parent(parent);
        let answer = async move {
            let matched = self.matched(&request)?;
            // Not held while the ledger decides: its text may be several times the message's
            // size (a byte that is not UTF-8 reads as three and two hex digits), and what was
            // matched holds none of it.
            drop(request);
            let decided = self.decide(&matched, deadline).await?;
            let response = self.respond(&matched, decided)?;
            let code = Code::try_from(response.overall_code).unwrap_or(Code::Unknown);
            tracing::Span::current().record("ratelimit.overall_code", code.as_str_name());
            Ok(Response::new(response))
        }
        .instrument(span.clone())
        .await;
        record_status(&span, answer.as_ref().err());
        answer
    }
}

/// What an answer needs to reach Envoy once decided, taken off its `grpc-timeout` (a fifth of
/// it at most): the call's decoding before the deadline is set, the timer's millisecond, the
/// answer's way back.
const ANSWER_MARGIN_MAX: Duration = Duration::from_millis(10);

/// A `grpc-timeout` value (gRPC over HTTP/2: 1 to 8 digits, then `H`, `M`, `S`, `m`, `u` or
/// `n`; a leading `+`, which tonic's own parse takes too); `None` when malformed, which tonic
/// ignores too (no timeout).
fn grpc_timeout(text: &[u8]) -> Option<Duration> {
    let text = text.strip_prefix(b"+").unwrap_or(text);
    let (unit, digits) = text.split_last()?;
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let value: u64 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    Some(match unit {
        b'H' => Duration::from_secs(value * 3600),
        b'M' => Duration::from_secs(value * 60),
        b'S' => Duration::from_secs(value),
        b'm' => Duration::from_millis(value),
        b'u' => Duration::from_micros(value),
        b'n' => Duration::from_nanos(value),
        _ => return None,
    })
}

/// The call's gRPC status on its span, and an error status for the server's own failures
/// (OpenTelemetry's RPC conventions: a client's bad argument is not the server's error). Before,
/// a call failed closed by a ledger outage was exported without one: a trace search for errors,
/// and the span metrics' failure counts, showed nothing through the outage.
fn record_status(span: &tracing::Span, error: Option<&Status>) {
    let code = error.map_or(tonic::Code::Ok, Status::code);
    span.record("rpc.grpc.status_code", code as i32);
    let server_error = matches!(
        code,
        tonic::Code::Unknown
            | tonic::Code::DeadlineExceeded
            | tonic::Code::Unimplemented
            | tonic::Code::Internal
            | tonic::Code::Unavailable
            | tonic::Code::DataLoss
    );
    if server_error {
        span.record("otel.status_code", "ERROR");
    }
}

impl RateLimitServer {
    /// Counts the shadow descriptors' decisions, on a call answered OK only: on one the enforced
    /// descriptors refused (or could not decide), a shadow descriptor's hold is voided, so it
    /// admitted nothing (and let nothing through), and counting it would weigh a refused call
    /// as admitted too.
    fn record_shadows(&self, matched: &[Matched], decided: &Decided) {
        let decision = &decided.enforced.1;
        let answered_ok =
            decision.refused_by.is_none() && !matches!(decision.outcome, Outcome::FailedClosed(_));
        if !answered_ok {
            return;
        }
        for (index, shadow) in &decided.shadow {
            if let Some(rule) = rule_of(&matched[*index]) {
                self.metrics.record_shadow(rule, &shadow.outcome);
            }
        }
    }

    /// One status per descriptor; OVER_LIMIT overall when an enforced descriptor refused;
    /// `UNAVAILABLE` when the ledger could not decide and the failure policy is closed.
    fn respond(&self, matched: &[Matched], decided: Decided) -> Result<RateLimitResponse, Status> {
        let (indices, decision) = &decided.enforced;
        assert_eq!(indices.len(), decision.limits.len());
        assert!(decided.shadow.iter().all(|(_, d)| d.limits.len() == 1));
        self.record(matched, indices, decision);
        self.record_shadows(matched, &decided);
        if let Outcome::FailedClosed(error) = &decision.outcome {
            // The error says which way (its deadline, the in-flight bound, the client): "in
            // time" was said of every one.
            return Err(Status::unavailable(format!(
                "the ledger could not decide: {error}"
            )));
        }
        let mut statuses: Vec<DescriptorStatus> = matched.iter().map(plain_status).collect();
        // A block refuses like a limit, and says when it ends the same way.
        let retry_after = match decision.outcome {
            Outcome::Limited {
                retry_after_seconds,
                ..
            }
            | Outcome::Blocked {
                retry_after_seconds,
                ..
            } => Some(retry_after_seconds),
            _ => None,
        };
        for (k, index) in indices.iter().enumerate() {
            let refused = decision.refused_by == Some(k);
            let quota = &decision.limits[k].quota;
            let reset = if refused { retry_after } else { None };
            // Another descriptor of a refused call that has no room for its hits either is
            // over its limit too, as envoyproxy/ratelimit marks each.
            let cost = limit_of(&matched[*index]).map_or(0, |l| l.cost);
            let spent = decision.refused_by.is_some() && quota.remaining < cost;
            statuses[*index] = counted_status(
                &matched[*index],
                quota.remaining,
                reset.unwrap_or(quota.reset_seconds),
                refused || spent,
            );
        }
        for (index, shadow) in &decided.shadow {
            let quota = &shadow.limits[0].quota;
            statuses[*index] = counted_status(
                &matched[*index],
                quota.remaining,
                quota.reset_seconds,
                false,
            );
        }
        released_statuses(matched, &decided.released, &mut statuses);
        let overall = if decision.refused_by.is_some() {
            Code::OverLimit
        } else {
            Code::Ok
        };
        // One status per descriptor, in order: Envoy pairs them by position.
        assert_eq!(statuses.len(), matched.len());
        // The refusing descriptor's fields, when one refused: others may be spent too, but its
        // reset is the Retry-After (the limit that comes back last).
        let refusing = decision.refused_by.map(|k| indices[k]);
        let headers = rate_limit_headers(matched, (indices, refusing), &statuses, retry_after);
        Ok(RateLimitResponse {
            overall_code: overall as i32,
            statuses,
            response_headers_to_add: headers,
            ..RateLimitResponse::default()
        })
    }

    /// One decision per enforced descriptor, labelled by its rule (a bounded, configured set).
    fn record(&self, matched: &[Matched], indices: &[usize], decision: &MultiDecision) {
        for (k, index) in indices.iter().enumerate() {
            let Some(rule) = rule_of(&matched[*index]) else {
                continue;
            };
            // A refusal is the refusing rule's; the others in the chain were not its cause.
            let counts = match decision.outcome {
                Outcome::Limited { .. } | Outcome::Blocked { .. } => decision.refused_by == Some(k),
                _ => true,
            };
            if counts {
                self.metrics.record(rule, &decision.outcome);
            }
        }
    }
}

fn rule_of(matched: &Matched) -> Option<&Rule> {
    match matched {
        Matched::Counted { rule, .. } => Some(rule),
        _ => None,
    }
}

fn limit_of(matched: &Matched) -> Option<&Limit> {
    match matched {
        Matched::Counted { limit, .. } => Some(limit),
        _ => None,
    }
}

/// The status of a descriptor no ledger call decides: no rule (OK, no limit, as
/// envoyproxy/ratelimit answers), or unlimited (OK, the most remaining there is).
fn plain_status(matched: &Matched) -> DescriptorStatus {
    let limit_remaining = match matched {
        Matched::Unlimited { .. } => u32::MAX,
        _ => 0,
    };
    DescriptorStatus {
        code: Code::Ok as i32,
        limit_remaining,
        ..DescriptorStatus::default()
    }
}

fn counted_status(
    matched: &Matched,
    remaining: u64,
    reset_seconds: u64,
    refused: bool,
) -> DescriptorStatus {
    let Matched::Counted {
        rule, limit, unit, ..
    } = matched
    else {
        return plain_status(matched);
    };
    let saturate = |n: u64| u32::try_from(n).unwrap_or(u32::MAX);
    // Something held and no known end (a check, a negative hit, an instance that never listed
    // the account): at the latest a window on, never 0, which says "whole now".
    let reset_seconds = match remaining < limit.account.capacity.get() && reset_seconds == 0 {
        true => u64::from(limit.account.window_seconds.get()),
        false => reset_seconds,
    };
    DescriptorStatus {
        code: if refused { Code::OverLimit } else { Code::Ok } as i32,
        current_limit: Some(RateLimit {
            name: rule.name.clone().unwrap_or_default(),
            requests_per_unit: saturate(limit.account.capacity.get()),
            unit: unit.map_or(0, Unit::proto),
        }),
        limit_remaining: saturate(remaining),
        duration_until_reset: Some(ProtoDuration {
            seconds: i64::try_from(reset_seconds).unwrap_or(i64::MAX),
            nanos: 0,
        }),
        ..DescriptorStatus::default()
    }
}

/// IETF `RateLimit-Policy` / `RateLimit` for the enforced descriptor closest to its limit (the one
/// that refused, if any), and `Retry-After` on OVER_LIMIT: the middleware's 429 fields.
/// The statuses of negative hits: what each left free, as its release read it.
fn released_statuses(
    matched: &[Matched],
    released: &[(usize, Option<u64>)],
    statuses: &mut [DescriptorStatus],
) {
    for (index, available) in released {
        let capacity = limit_of(&matched[*index]).map_or(0, |l| l.account.capacity.get());
        // Unknown (a release or its read failed) claims nothing; at most the limit, as ever.
        let free = available.map_or(0, |free| free.min(capacity));
        statuses[*index] = counted_status(&matched[*index], free, 0, false);
    }
}

fn rate_limit_headers(
    matched: &[Matched],
    (enforced, refusing): (&[usize], Option<usize>),
    statuses: &[DescriptorStatus],
    retry_after: Option<u64>,
) -> Vec<HeaderValue> {
    let closest = enforced
        .iter()
        .copied()
        .filter(|i| statuses[*i].current_limit.is_some())
        .min_by_key(|i| {
            (
                statuses[*i].code != Code::OverLimit as i32,
                statuses[*i].limit_remaining,
            )
        });
    let Some(index) = refusing.or(closest) else {
        return Vec::new();
    };
    let (Some(rule), Some(limit)) = (rule_of(&matched[index]), limit_of(&matched[index])) else {
        return Vec::new();
    };
    let status = &statuses[index];
    let name = policy_name(rule);
    let reset = status.duration_until_reset.map_or(0, |d| d.seconds);
    let header = |key: &str, value: String| HeaderValue {
        key: key.to_owned(),
        value,
        ..HeaderValue::default()
    };
    let mut headers = vec![
        header(
            "RateLimit-Policy",
            format!(
                "\"{name}\";q={};w={}",
                limit.account.capacity, limit.account.window_seconds
            ),
        ),
        header(
            "RateLimit",
            format!("\"{name}\";r={};t={reset}", status.limit_remaining),
        ),
    ];
    if let Some(seconds) = retry_after {
        headers.push(header("Retry-After", seconds.to_string()));
    }
    headers
}

/// The policy's name in the fields: the rule's `name`, else its last key (with its configured
/// value as the metric label has it, a hash: a value may be a partner's API key, and these
/// headers reach every caller and their logs); only characters a structured-field string
/// carries plainly.
fn policy_name(rule: &Rule) -> String {
    let name = rule
        .name
        .as_deref()
        .unwrap_or_else(|| rule.label.rsplit('.').next().unwrap_or("limit"));
    name.chars()
        .take(64)
        .map(|c| {
            if c.is_ascii_graphic() && c != '"' && c != '\\' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grpc_timeout_is_read_as_grpc_writes_it() {
        let ms = Duration::from_millis;
        let cases: [(&[u8], Option<Duration>); 13] = [
            (b"20m", Some(ms(20))),
            (b"+5m", Some(ms(5))),
            (b"++5m", None),
            (b"1S", Some(ms(1_000))),
            (b"2M", Some(ms(120_000))),
            (b"1H", Some(ms(3_600_000))),
            (b"250u", Some(Duration::from_micros(250))),
            (b"99999999n", Some(Duration::from_nanos(99_999_999))),
            (b"123456789m", None), // over 8 digits
            (b"m", None),
            (b"20", None),
            (b"20x", None),
            (b"-1m", None),
        ];
        for (text, expected) in cases {
            let shown = String::from_utf8_lossy(text);
            assert_eq!(grpc_timeout(text), expected, "{shown}");
        }
    }

    /// The fields recorded on spans, by name, as text.
    #[derive(Clone, Default)]
    struct Recorded(Arc<std::sync::Mutex<Vec<(String, String)>>>);

    impl tracing::field::Visit for Recorded {
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            let value = format!("{value:?}").trim_matches('"').to_owned();
            self.0
                .lock()
                .unwrap()
                .push((field.name().to_owned(), value));
        }
    }

    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Recorded {
        fn on_record(
            &self,
            _: &tracing::span::Id,
            values: &tracing::span::Record<'_>,
            _: tracing_subscriber::layer::Context<'_, S>,
        ) {
            values.record(&mut self.clone());
        }
    }

    /// A call the server could not answer (failed closed: `UNAVAILABLE`) is an error span, by
    /// OpenTelemetry's RPC conventions; a client's bad argument, or an answer, is not.
    #[test]
    fn a_server_error_is_an_error_span_and_a_bad_argument_is_not() {
        use tracing_subscriber::layer::SubscriberExt;
        let status_of = |error: Option<Status>| {
            let recorded = Recorded::default();
            let subscriber = tracing_subscriber::registry().with(recorded.clone());
            tracing::subscriber::with_default(subscriber, || {
                let span = tracing::info_span!(
                    "call",
                    rpc.grpc.status_code = tracing::field::Empty,
                    otel.status_code = tracing::field::Empty,
                );
                record_status(&span, error.as_ref());
            });
            let fields = recorded.0.lock().unwrap().clone();
            let field = |name: &str| {
                let found = fields.iter().find(|(n, _)| n == name);
                found.map(|(_, value)| value.clone())
            };
            (field("rpc.grpc.status_code"), field("otel.status_code"))
        };
        let text = |s: &str| Some(s.to_owned());
        let unavailable = status_of(Some(Status::unavailable("the ledger could not decide")));
        assert_eq!(unavailable, (text("14"), text("ERROR")));
        let bad = status_of(Some(Status::invalid_argument("no descriptors")));
        assert_eq!(bad, (text("3"), None));
        assert_eq!(status_of(None), (text("0"), None));
    }

    #[test]
    fn a_policy_name_never_shows_a_configured_value() {
        let mut config = RlsConfig::default();
        let rules = "domain: d\ndescriptors:\n  - key: api_key\n    value: sk_live_partner_1234\n    rate_limit: {unit: minute, requests_per_unit: 5}\n  - key: tenant\n    rate_limit: {name: per-tenant, unit: second, requests_per_unit: 1}\n";
        config.add("rules.yaml", rules).unwrap();
        let keyed = config
            .rule_for("d", [("api_key", "sk_live_partner_1234")].into_iter())
            .unwrap();
        let name = policy_name(&keyed);
        assert!(!name.contains("sk_live"), "{name}");
        assert!(name.starts_with("api_key_"), "{name}");
        let named = config
            .rule_for("d", [("tenant", "t1")].into_iter())
            .unwrap();
        assert_eq!(policy_name(&named), "per-tenant");
    }
}
