//! The ledger's own metrics: call latency by operation, failures by kind, calls in flight.
//!
//! Recorded through the `metrics` facade (the binary exports them with
//! `metrics-exporter-prometheus`; a library user may install any recorder). Every label is a closed
//! enum: the label sets are bounded, and no account id ever becomes a label.

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};
use metrics::{Counter, Gauge, Histogram};

pub const LEDGER_CALL_DURATION_SECONDS: &str = "ledger_limiter_ledger_call_duration_seconds";
pub const LEDGER_ERRORS_TOTAL: &str = "ledger_limiter_ledger_errors_total";
/// Calls made by batches of single transfers (`batch.rs`): admitted requests per batch is how
/// well the batching (and `ledger.batch_linger_ms`) packs.
pub const LEDGER_BATCHES_TOTAL: &str = "ledger_limiter_ledger_batches_total";
pub const LEDGER_IN_FLIGHT: &str = "ledger_limiter_ledger_in_flight";
/// The bound on calls in flight (`ledger.in_flight_max`): `in_flight / in_flight_max` near 1 means
/// the ledger is falling behind, before calls are refused as `overloaded`.
pub const LEDGER_IN_FLIGHT_MAX: &str = "ledger_limiter_ledger_in_flight_max";

/// Buckets for ledger calls: TigerBeetle answers in well under a millisecond when healthy; the
/// upper buckets catch a slow ledger up to the longest deadline (`ledger.timeout_ms` up to
/// 60 s): a call that times out is recorded at its deadline, and with a last bucket below it the
/// dashboard's p99 and "Ledger headroom" stopped at that bucket, never reaching 100 %.
pub const LEDGER_CALL_BUCKETS_SECONDS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0,
];

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

/// How a ledger call ended, from the caller's point of view (the `outcome` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CallStatus {
    /// The ledger answered (including per-event results such as `exceeds_credits`).
    Ok,
    /// The client reported a failure for the whole call.
    Error,
}

impl CallStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            CallStatus::Ok => "ok",
            CallStatus::Error => "error",
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
    batches: Counter,
}

impl LedgerMetrics {
    pub fn register(in_flight_max: usize) -> Self {
        describe_histogram!(
            LEDGER_CALL_DURATION_SECONDS,
            metrics::Unit::Seconds,
            "Duration of TigerBeetle calls, by operation and outcome"
        );
        describe_counter!(
            LEDGER_ERRORS_TOTAL,
            "Ledger calls that failed (each one applies the failure policy), by kind"
        );
        describe_gauge!(
            LEDGER_IN_FLIGHT,
            "Ledger calls in flight, one per decision's call (holds batched into one \
             create_transfers count one each)"
        );
        describe_counter!(
            LEDGER_BATCHES_TOTAL,
            "create_transfers calls made by batches of single transfers (holds, voids, grants, \
             leases): admitted requests divided by this is about the transfers per call"
        );
        describe_gauge!(
            LEDGER_IN_FLIGHT_MAX,
            "The bound on TigerBeetle calls in flight"
        );
        gauge!(LEDGER_IN_FLIGHT_MAX).set(in_flight_max as f64);
        let calls = Operation::ALL
            .iter()
            .flat_map(|operation| {
                [CallStatus::Ok, CallStatus::Error].map(|status| {
                    histogram!(
                        LEDGER_CALL_DURATION_SECONDS,
                        "operation" => operation.as_str(),
                        "outcome" => status.as_str()
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
        let batches = counter!(LEDGER_BATCHES_TOTAL);
        batches.absolute(0);
        LedgerMetrics {
            calls,
            errors,
            in_flight,
            batches,
        }
    }

    pub fn record_call(&self, operation: Operation, status: CallStatus, seconds: f64) {
        self.calls[operation as usize * 2 + status as usize].record(seconds);
    }

    pub fn record_error(&self, kind: LedgerErrorKind) {
        self.errors[kind as usize].increment(1);
    }

    pub fn in_flight_set(&self, calls: usize) {
        self.in_flight.set(calls as f64);
    }

    pub fn batches_set(&self, sent: u64) {
        self.batches.absolute(sent);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_bucket_holds_the_longest_deadline() {
        let last = *LEDGER_CALL_BUCKETS_SECONDS.last().unwrap();
        let longest = crate::config::LEDGER_TIMEOUT_MS_MAX as f64 / 1000.0;
        assert!(last >= longest, "{last} s < {longest} s");
        let ascending = LEDGER_CALL_BUCKETS_SECONDS.windows(2);
        assert!(ascending.into_iter().all(|pair| pair[0] < pair[1]));
    }

    #[test]
    fn enum_discriminants_index_their_handles() {
        for (i, o) in Operation::ALL.iter().enumerate() {
            assert_eq!(*o as usize, i);
        }
        for (i, k) in LedgerErrorKind::ALL.iter().enumerate() {
            assert_eq!(*k as usize, i);
        }
        assert_eq!(CallStatus::Ok as usize, 0);
        assert_eq!(CallStatus::Error as usize, 1);
    }

    #[test]
    fn label_values_are_prometheus_friendly() {
        for v in Operation::ALL
            .iter()
            .map(|o| o.as_str())
            .chain(LedgerErrorKind::ALL.iter().map(|k| k.as_str()))
        {
            assert!(
                v.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
                "{v}"
            );
        }
    }
}
