//! The decision counter, `ledger_limiter_decisions_total{decision, plan, source}`, recorded by the
//! limiter itself. Every label is a closed enum or a configured plan name: the label sets are
//! bounded, and no caller key or account id ever becomes a label (those go on spans). Every valid
//! combination is registered at zero, so dashboards show 0 rather than "no data".

use metrics::{counter, describe_counter, Counter};

use super::counts::ThreadCounts;
use super::plan::{PlanBook, PlanId};
use super::{DecisionSource, Outcome};

pub const DECISIONS_TOTAL: &str = "ledger_limiter_decisions_total";
/// The deadline of one decision (`ledger.timeout_ms`): the ledger's p99 call latency as a share of
/// it shows the ledger falling behind before decisions fail.
pub const DECISION_DEADLINE_SECONDS: &str = "ledger_limiter_decision_deadline_seconds";

/// Refusals let through because their route is in shadow mode, by plan and decision (`limited`
/// or `failed_closed`): what enforcing the limit would have refused.
pub const SHADOW_PASSED_TOTAL: &str = "ledger_limiter_shadow_passed_total";
/// Admitted requests whose hold was voided because the handler failed, by plan.
pub const REFUNDS_TOTAL: &str = "ledger_limiter_refunds_total";
/// Requests refused by one of a route's further limits, by limit.
pub const ROUTE_LIMIT_REFUSALS_TOTAL: &str = "ledger_limiter_route_limit_refusals_total";

/// The `plan` label of decisions made before a plan is known (a rejected key).
pub const PLAN_NONE: &str = "none";

/// The start of the `plan` label of a route's concurrency limit (`concurrency-<hash>`), which
/// the dashboard's request panels leave out: a slot is not a request.
pub const CONCURRENCY_PLAN_PREFIX: &str = "concurrency-";

/// What the limiter decided for one request (the `decision` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DecisionLabel {
    Admitted,
    Limited,
    FailedOpen,
    FailedClosed,
    RejectedKey,
    Blocked,
}

impl DecisionLabel {
    pub const ALL: [DecisionLabel; 6] = [
        DecisionLabel::Admitted,
        DecisionLabel::Limited,
        DecisionLabel::FailedOpen,
        DecisionLabel::FailedClosed,
        DecisionLabel::RejectedKey,
        DecisionLabel::Blocked,
    ];

    pub fn of(outcome: &Outcome) -> Self {
        match outcome {
            Outcome::Admitted => DecisionLabel::Admitted,
            Outcome::Limited { .. } => DecisionLabel::Limited,
            Outcome::Blocked { .. } => DecisionLabel::Blocked,
            Outcome::FailedOpen(_) => DecisionLabel::FailedOpen,
            Outcome::FailedClosed(_) => DecisionLabel::FailedClosed,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            DecisionLabel::Admitted => "admitted",
            DecisionLabel::Limited => "limited",
            DecisionLabel::FailedOpen => "failed_open",
            DecisionLabel::FailedClosed => "failed_closed",
            DecisionLabel::RejectedKey => "rejected_key",
            DecisionLabel::Blocked => "blocked",
        }
    }
}

/// Where a decision came from (the `source` label): the ledger, this instance's local view, or
/// neither (a rejected key, a failure policy).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SourceLabel {
    Ledger,
    LocalView,
    None,
}

impl SourceLabel {
    pub const ALL: [SourceLabel; 3] = [
        SourceLabel::Ledger,
        SourceLabel::LocalView,
        SourceLabel::None,
    ];

    pub fn of(outcome: &Outcome) -> Self {
        match outcome {
            Outcome::Admitted => SourceLabel::Ledger,
            Outcome::Limited { source, .. } | Outcome::Blocked { source, .. } => match source {
                DecisionSource::Ledger => SourceLabel::Ledger,
                DecisionSource::LocalView => SourceLabel::LocalView,
            },
            Outcome::FailedOpen(_) | Outcome::FailedClosed(_) => SourceLabel::None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            SourceLabel::Ledger => "ledger",
            SourceLabel::LocalView => "local_view",
            SourceLabel::None => "none",
        }
    }
}

/// Handles for the decision counter, one per valid (decision, plan, source), made once so that
/// counting neither allocates nor hashes label sets.
pub struct DecisionMetrics {
    /// Indexed by [`DecisionMetrics::index`]; invalid combinations hold no-op counters. Counted
    /// per thread ([`ThreadCounts`]): [`DecisionMetrics::drain`] before reading them.
    counts: ThreadCounts,
    /// Per plan: [limited, failed_closed] let through in shadow mode.
    shadow: Vec<[Counter; 2]>,
    /// Per plan: refunds.
    refunds: Vec<Counter>,
}

const SOURCES: usize = SourceLabel::ALL.len();
const DECISIONS: usize = DecisionLabel::ALL.len();

impl DecisionMetrics {
    /// Install the `metrics` recorder first: the counters bind to it here.
    pub fn register(plans: &PlanBook, deadline: std::time::Duration) -> Self {
        metrics::describe_gauge!(
            DECISION_DEADLINE_SECONDS,
            metrics::Unit::Seconds,
            "The deadline of one decision"
        );
        metrics::gauge!(DECISION_DEADLINE_SECONDS).set(deadline.as_secs_f64());
        describe_counter!(
            ROUTE_LIMIT_REFUSALS_TOTAL,
            "Requests refused by one of a route's further limits (routes.limits), by limit"
        );
        describe_counter!(
            DECISIONS_TOTAL,
            "Rate-limit decisions, by decision, plan and where the decision came from"
        );
        let mut plan_names: Vec<&str> = vec![PLAN_NONE];
        plan_names.extend(plans.plans().iter().map(|p| p.name()));
        let mut counters = Vec::with_capacity(plan_names.len() * DECISIONS * SOURCES);
        for plan in plan_names {
            for decision in DecisionLabel::ALL {
                for source in SourceLabel::ALL {
                    counters.push(if valid_combination(decision, plan, source) {
                        let counter = counter!(
                            DECISIONS_TOTAL,
                            "decision" => decision.as_str(),
                            "plan" => plan.to_owned(),
                            "source" => source.as_str()
                        );
                        counter.absolute(0);
                        counter
                    } else {
                        Counter::noop()
                    });
                }
            }
        }
        let shadow = plans
            .plans()
            .iter()
            .map(|plan| shadow_counters(plan.name()))
            .collect();
        describe_counter!(
            REFUNDS_TOTAL,
            "Admitted requests whose hold was voided because the handler failed, by plan"
        );
        let refunds = plans
            .plans()
            .iter()
            .map(|plan| {
                let counter = counter!(REFUNDS_TOTAL, "plan" => plan.name().to_owned());
                counter.absolute(0);
                counter
            })
            .collect();
        DecisionMetrics {
            counts: ThreadCounts::new(counters),
            shadow,
            refunds,
        }
    }

    /// Counts a refund.
    pub fn record_refund(&self, plan: PlanId) {
        if let Some(counter) = self.refunds.get(plan.index()) {
            counter.increment(1);
        }
    }

    /// Counts a refusal by one of a route's limits (its name is a configured, bounded label).
    pub fn record_route_limit_refusal(&self, limit: &str) {
        counter!(ROUTE_LIMIT_REFUSALS_TOTAL, "limit" => limit.to_owned()).increment(1);
    }

    /// Counts a refusal let through in shadow mode.
    pub fn record_shadow(&self, plan: PlanId, decision: DecisionLabel) {
        let slot = match decision {
            DecisionLabel::Limited => 0,
            DecisionLabel::FailedClosed => 1,
            _ => return,
        };
        if let Some(counters) = self.shadow.get(plan.index()) {
            counters[slot].increment(1);
        }
    }

    fn index(decision: DecisionLabel, plan: Option<PlanId>, source: SourceLabel) -> usize {
        let plan = plan.map_or(0, |p| p.index() + 1);
        (plan * DECISIONS + decision as usize) * SOURCES + source as usize
    }

    /// Counts one decision; `plan` is `None` for a rejected key. A plan this book does not have
    /// counts nowhere (a library user mixing limiters), rather than panicking.
    pub fn record(&self, decision: DecisionLabel, plan: Option<PlanId>, source: SourceLabel) {
        self.counts.add(Self::index(decision, plan, source), 1);
    }

    /// Moves the decisions each thread counted to the decision counter (before a scrape).
    pub fn drain(&self) {
        self.counts.drain();
    }
}

fn shadow_counters(plan: &str) -> [Counter; 2] {
    describe_counter!(
        SHADOW_PASSED_TOTAL,
        "Refusals let through because their route is in shadow mode, by plan and decision"
    );
    [DecisionLabel::Limited, DecisionLabel::FailedClosed].map(|decision| {
        let counter = counter!(
            SHADOW_PASSED_TOTAL,
            "decision" => decision.as_str(),
            "plan" => plan.to_owned()
        );
        counter.absolute(0);
        counter
    })
}

fn valid_combination(decision: DecisionLabel, plan: &str, source: SourceLabel) -> bool {
    match decision {
        DecisionLabel::RejectedKey => plan == PLAN_NONE && source == SourceLabel::None,
        DecisionLabel::Limited | DecisionLabel::Blocked => {
            plan != PLAN_NONE && matches!(source, SourceLabel::Ledger | SourceLabel::LocalView)
        }
        DecisionLabel::Admitted => plan != PLAN_NONE && source == SourceLabel::Ledger,
        DecisionLabel::FailedOpen | DecisionLabel::FailedClosed => {
            plan != PLAN_NONE && source == SourceLabel::None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enum_discriminants_index_their_handles() {
        for (i, d) in DecisionLabel::ALL.iter().enumerate() {
            assert_eq!(*d as usize, i);
        }
        for (i, s) in SourceLabel::ALL.iter().enumerate() {
            assert_eq!(*s as usize, i);
        }
    }

    #[test]
    fn label_values_are_prometheus_friendly_and_unique() {
        let mut all: Vec<&str> = DecisionLabel::ALL.iter().map(|d| d.as_str()).collect();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), DecisionLabel::ALL.len());
        for v in DecisionLabel::ALL
            .iter()
            .map(|d| d.as_str())
            .chain(SourceLabel::ALL.iter().map(|s| s.as_str()))
        {
            assert!(
                v.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
                "{v}"
            );
        }
    }
}
