//! The RLS front end's decisions, in the middleware's metric families with a `frontend="envoy"`
//! label: `ledger_limiter_decisions_total{frontend, decision, plan, source}` (`plan` is the
//! matched rule: its `name`, else its envoyproxy/ratelimit stats key with each configured value
//! as a hash ([`Rule::label`]), a configured and bounded set; descriptor values never become
//! labels), `ledger_limiter_shadow_passed_total{frontend,
//! plan, decision}`, `ledger_limiter_rls_released_units_total` for negative hits, and
//! `ledger_limiter_rls_shed_calls_total` for calls past `rls.calls_max`. The
//! middleware's own series carry no `frontend` label (`{frontend=""}` in PromQL selects them).

use metrics::counter;

use super::config::Rule;
use crate::limiter::metrics::{DecisionLabel, SourceLabel, DECISIONS_TOTAL, SHADOW_PASSED_TOTAL};
use crate::limiter::Outcome;

pub const FRONTEND: &str = "envoy";
/// Units given back by `is_negative_hits`.
pub const RELEASED_UNITS_TOTAL: &str = "ledger_limiter_rls_released_units_total";
/// Calls past `rls.calls_max`, answered under the failure policy without a decision.
pub const SHED_CALLS_TOTAL: &str = "ledger_limiter_rls_shed_calls_total";
/// Changes to the rules' files, by outcome: `loaded` (in force now) or `refused` (not loaded;
/// the rules in force stay).
pub const RULES_CHANGES_TOTAL: &str = "ledger_limiter_rls_rules_changes_total";

/// Counts the RLS front end's decisions (the recorder is read at each count, so the front end works
/// with or without one).
#[derive(Debug, Default)]
pub struct RlsMetrics;

impl RlsMetrics {
    pub fn register() -> Self {
        metrics::describe_counter!(
            RELEASED_UNITS_TOTAL,
            "Units given back by Envoy's is_negative_hits"
        );
        counter!(RELEASED_UNITS_TOTAL).absolute(0);
        metrics::describe_counter!(
            SHED_CALLS_TOTAL,
            "Envoy calls past rls.calls_max, answered under the failure policy without a decision"
        );
        counter!(SHED_CALLS_TOTAL).absolute(0);
        metrics::describe_counter!(
            RULES_CHANGES_TOTAL,
            "Changes to the Envoy rules' files, by outcome: loaded, or refused (the rules in force stay)"
        );
        for outcome in ["loaded", "refused"] {
            counter!(RULES_CHANGES_TOTAL, "outcome" => outcome).absolute(0);
        }
        RlsMetrics
    }

    pub fn record(&self, rule: &Rule, outcome: &Outcome) {
        let decision = DecisionLabel::of(outcome);
        let source = SourceLabel::of(outcome);
        counter!(
            DECISIONS_TOTAL,
            "frontend" => FRONTEND,
            "decision" => decision.as_str(),
            "plan" => label(rule),
            "source" => source.as_str()
        )
        .increment(1);
    }

    /// A shadow-mode descriptor: counted as decided; a refusal also as let through. A block is
    /// one here: a shadow rule never denies, not even an account an operator blocked (the HTTP
    /// front end's shadow routes refuse a block, so its series has no `blocked`).
    pub fn record_shadow(&self, rule: &Rule, outcome: &Outcome) {
        self.record(rule, outcome);
        let decision = DecisionLabel::of(outcome);
        if matches!(
            decision,
            DecisionLabel::Limited | DecisionLabel::FailedClosed | DecisionLabel::Blocked
        ) {
            counter!(
                SHADOW_PASSED_TOTAL,
                "frontend" => FRONTEND,
                "decision" => decision.as_str(),
                "plan" => label(rule)
            )
            .increment(1);
        }
    }

    pub fn record_shed(&self) {
        counter!(SHED_CALLS_TOTAL).increment(1);
    }

    /// A change to the rules' files: `loaded`, or refused.
    pub fn record_rules_change(&self, loaded: bool) {
        let outcome = if loaded { "loaded" } else { "refused" };
        counter!(RULES_CHANGES_TOTAL, "outcome" => outcome).increment(1);
    }

    pub fn record_release(&self, units: u64) {
        counter!(RELEASED_UNITS_TOTAL).increment(units);
    }
}

/// How a rule is named wherever it may be read (metrics, the admin API): its `name`, else its
/// label, which never shows a configured value.
pub fn label(rule: &Rule) -> String {
    rule.name.clone().unwrap_or_else(|| rule.label.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envoy::config::RuleLimit;
    use crate::ledger::LedgerError;

    fn shadow_rule() -> Rule {
        Rule {
            path: "d.k".into(),
            label: "d.k".into(),
            name: Some("spent".to_owned()),
            limit: RuleLimit::Unlimited,
            replaces: Vec::new(),
            shadow_mode: true,
            detailed_metric: false,
            concurrency: false,
        }
    }

    /// Every refusal a shadow rule lets through is counted as passed, a block among them (it was
    /// not: the one refusal an operator made was missing from the shadow panel).
    #[test]
    fn a_shadow_rule_counts_every_refusal_it_lets_through() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            let metrics = RlsMetrics::register();
            let rule = shadow_rule();
            let refusals = [
                Outcome::Limited {
                    retry_after_seconds: 3,
                    source: crate::limiter::DecisionSource::Ledger,
                },
                Outcome::Blocked {
                    retry_after_seconds: 3,
                    source: crate::limiter::DecisionSource::Ledger,
                },
                Outcome::FailedClosed(LedgerError::Overloaded { in_flight_max: 1 }),
                Outcome::Admitted,
            ];
            for outcome in &refusals {
                metrics.record_shadow(&rule, outcome);
            }
        });
        let text = handle.render();
        for decision in ["limited", "blocked", "failed_closed"] {
            let series = format!(
                "ledger_limiter_shadow_passed_total{{frontend=\"envoy\",decision=\"{decision}\",plan=\"spent\"}} 1"
            );
            assert!(text.contains(&series), "{series} in:\n{text}");
        }
        let passed = text
            .lines()
            .filter(|l| l.starts_with("ledger_limiter_shadow_passed_total{"));
        assert_eq!(passed.count(), 3, "{text}");
    }
}
