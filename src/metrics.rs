//! Typed metrics, recorded through the `metrics` facade (the binary exports them with
//! `metrics-exporter-prometheus`; a library user may install any recorder).
//!
//! Every label is a closed enum or a configured plan name: the label sets are bounded, and no
//! caller key or account id ever becomes a label (those go on spans). Every known label
//! combination is registered at zero by [`describe`], so dashboards show 0 rather than "no data".

use metrics::{
    counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram, Counter,
    Gauge, Histogram,
};

use crate::plan::{PlanBook, PlanId};

pub const DECISIONS_TOTAL: &str = "ledger_limiter_decisions_total";
pub const LEDGER_CALL_DURATION_SECONDS: &str = "ledger_limiter_ledger_call_duration_seconds";
pub const LEDGER_ERRORS_TOTAL: &str = "ledger_limiter_ledger_errors_total";
pub const LEDGER_IN_FLIGHT: &str = "ledger_limiter_ledger_in_flight";

/// Buckets for ledger calls: TigerBeetle answers in well under a millisecond when healthy; the
/// upper buckets catch a slow ledger up to the deadline.
pub const LEDGER_CALL_BUCKETS_SECONDS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

/// What the limiter decided for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DecisionLabel {
    Admitted,
    Limited,
    FailedOpen,
    FailedClosed,
    RejectedKey,
}

impl DecisionLabel {
    pub const ALL: [DecisionLabel; 5] = [
        DecisionLabel::Admitted,
        DecisionLabel::Limited,
        DecisionLabel::FailedOpen,
        DecisionLabel::FailedClosed,
        DecisionLabel::RejectedKey,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DecisionLabel::Admitted => "admitted",
            DecisionLabel::Limited => "limited",
            DecisionLabel::FailedOpen => "failed_open",
            DecisionLabel::FailedClosed => "failed_closed",
            DecisionLabel::RejectedKey => "rejected_key",
        }
    }
}

/// Where a decision came from: the ledger, or this instance's memory of an exhausted caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DecisionSource {
    Ledger,
    LocalCache,
    None,
}

impl DecisionSource {
    pub const ALL: [DecisionSource; 3] = [
        DecisionSource::Ledger,
        DecisionSource::LocalCache,
        DecisionSource::None,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DecisionSource::Ledger => "ledger",
            DecisionSource::LocalCache => "local_cache",
            DecisionSource::None => "none",
        }
    }
}

/// The TigerBeetle operations the limiter performs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operation {
    CreateAccounts,
    CreateTransfers,
    LookupAccounts,
    GetAccountTransfers,
}

impl Operation {
    pub const ALL: [Operation; 4] = [
        Operation::CreateAccounts,
        Operation::CreateTransfers,
        Operation::LookupAccounts,
        Operation::GetAccountTransfers,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Operation::CreateAccounts => "create_accounts",
            Operation::CreateTransfers => "create_transfers",
            Operation::LookupAccounts => "lookup_accounts",
            Operation::GetAccountTransfers => "get_account_transfers",
        }
    }
}

/// How a ledger call ended, from the caller's point of view.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CallOutcome {
    /// The ledger answered (including per-event results such as `exceeds_credits`).
    Ok,
    /// The client reported a failure for the whole call.
    Error,
}

impl CallOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            CallOutcome::Ok => "ok",
            CallOutcome::Error => "error",
        }
    }
}

/// Why a ledger call failed; each one triggers the failure policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LedgerErrorKind {
    /// No answer within the deadline.
    Timeout,
    /// Too many calls already in flight: refused without queueing.
    Overloaded,
    /// The client failed the whole request (evicted, shut down, ...).
    Client,
    /// The ledger answered with a result the model does not expect (a bug or a foreign account).
    Unexpected,
}

impl LedgerErrorKind {
    pub const ALL: [LedgerErrorKind; 4] = [
        LedgerErrorKind::Timeout,
        LedgerErrorKind::Overloaded,
        LedgerErrorKind::Client,
        LedgerErrorKind::Unexpected,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            LedgerErrorKind::Timeout => "timeout",
            LedgerErrorKind::Overloaded => "overloaded",
            LedgerErrorKind::Client => "client",
            LedgerErrorKind::Unexpected => "unexpected",
        }
    }
}

/// Handles for the ledger's metrics, made once (after the recorder is installed) so that recording
/// on the hot path neither allocates nor hashes label sets.
pub struct LedgerMetrics {
    calls: Vec<Histogram>,
    errors: Vec<Counter>,
    in_flight: Gauge,
}

impl LedgerMetrics {
    pub fn register() -> Self {
        describe_histogram!(
            LEDGER_CALL_DURATION_SECONDS,
            metrics::Unit::Seconds,
            "Duration of TigerBeetle calls, by operation and outcome"
        );
        describe_counter!(
            LEDGER_ERRORS_TOTAL,
            "Ledger calls that failed (each one applies the failure policy), by kind"
        );
        describe_gauge!(LEDGER_IN_FLIGHT, "TigerBeetle calls in flight");
        let calls = Operation::ALL
            .iter()
            .flat_map(|operation| {
                [CallOutcome::Ok, CallOutcome::Error].map(|outcome| {
                    histogram!(
                        LEDGER_CALL_DURATION_SECONDS,
                        "operation" => operation.as_str(),
                        "outcome" => outcome.as_str()
                    )
                })
            })
            .collect();
        let errors = LedgerErrorKind::ALL
            .iter()
            .map(|kind| {
                let counter = counter!(LEDGER_ERRORS_TOTAL, "kind" => kind.as_str());
                counter.absolute(0);
                counter
            })
            .collect();
        let in_flight = gauge!(LEDGER_IN_FLIGHT);
        in_flight.set(0.0);
        LedgerMetrics {
            calls,
            errors,
            in_flight,
        }
    }

    pub fn record_call(&self, operation: Operation, outcome: CallOutcome, seconds: f64) {
        self.calls[operation as usize * 2 + outcome as usize].record(seconds);
    }

    pub fn record_error(&self, kind: LedgerErrorKind) {
        self.errors[kind as usize].increment(1);
    }

    pub fn in_flight_add(&self, delta: f64) {
        self.in_flight.increment(delta);
    }
}

/// Handles for `ledger_limiter_decisions_total`, one per valid (decision, plan, source), all
/// registered at zero so dashboards show 0 rather than "no data".
pub struct DecisionMetrics {
    /// Indexed by [`DecisionMetrics::index`]; invalid combinations hold no-op counters.
    counters: Vec<Counter>,
}

const SOURCES: usize = DecisionSource::ALL.len();
const DECISIONS: usize = DecisionLabel::ALL.len();

impl DecisionMetrics {
    pub fn register(plans: &PlanBook) -> Self {
        describe_counter!(
            DECISIONS_TOTAL,
            "Rate-limit decisions, by decision, plan and where the decision came from"
        );
        let mut plan_names: Vec<&str> = vec![PLAN_NONE];
        plan_names.extend(plans.plans().iter().map(|p| p.name()));
        let mut counters = Vec::with_capacity(plan_names.len() * DECISIONS * SOURCES);
        for plan in plan_names {
            for decision in DecisionLabel::ALL {
                for source in DecisionSource::ALL {
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
        DecisionMetrics { counters }
    }

    fn index(decision: DecisionLabel, plan: Option<PlanId>, source: DecisionSource) -> usize {
        let plan = plan.map_or(0, |p| p.index() + 1);
        (plan * DECISIONS + decision as usize) * SOURCES + source as usize
    }

    /// Counts one decision; `plan` is `None` for a rejected key.
    pub fn record(&self, decision: DecisionLabel, plan: Option<PlanId>, source: DecisionSource) {
        self.counters[Self::index(decision, plan, source)].increment(1);
    }
}

/// The `plan` label of decisions made before a plan is known (a rejected key).
pub const PLAN_NONE: &str = "none";

fn valid_combination(decision: DecisionLabel, plan: &str, source: DecisionSource) -> bool {
    match decision {
        DecisionLabel::RejectedKey => plan == PLAN_NONE && source == DecisionSource::None,
        DecisionLabel::Limited => {
            plan != PLAN_NONE
                && matches!(source, DecisionSource::Ledger | DecisionSource::LocalCache)
        }
        DecisionLabel::Admitted => plan != PLAN_NONE && source == DecisionSource::Ledger,
        DecisionLabel::FailedOpen | DecisionLabel::FailedClosed => {
            plan != PLAN_NONE && source == DecisionSource::None
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
        for (i, s) in DecisionSource::ALL.iter().enumerate() {
            assert_eq!(*s as usize, i);
        }
        for (i, o) in Operation::ALL.iter().enumerate() {
            assert_eq!(*o as usize, i);
        }
        for (i, k) in LedgerErrorKind::ALL.iter().enumerate() {
            assert_eq!(*k as usize, i);
        }
        assert_eq!(CallOutcome::Ok as usize, 0);
        assert_eq!(CallOutcome::Error as usize, 1);
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
            .chain(Operation::ALL.iter().map(|o| o.as_str()))
            .chain(LedgerErrorKind::ALL.iter().map(|k| k.as_str()))
            .chain(DecisionSource::ALL.iter().map(|s| s.as_str()))
        {
            assert!(
                v.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
                "{v}"
            );
        }
    }
}
