//! The limiter's two seams: the ledger it decides with ([`Store`], implemented by
//! [`crate::ledger::Ledger`]) and the clock it reads ([`Clock`]). Production uses the real
//! ones; unit tests script a store and drive a clock to reach every branch of a decision, while the
//! real-TigerBeetle tests remain the proof of behaviour.

use std::future::Future;
use std::time::{Instant, SystemTime};

use crate::ledger::lease::{Settled, Settlement};
use crate::ledger::metrics::Operation;
use crate::ledger::model::UserAccount;
use crate::ledger::{
    AccountFree, AccountView, ChainLink, ChainReply, HoldReply, Ledger, LedgerError,
};

/// What a decision needs from the ledger. Every call ends by `deadline`.
pub trait Store: Send + Sync + 'static {
    /// The TigerBeetle ledger the accounts live on (part of every account id).
    fn ledger_id(&self) -> u32;

    /// One pending debit of `amount` for `timeout_seconds`. With `void_if_abandoned`, a hold that
    /// lands after the caller stopped waiting is voided.
    fn hold(
        &self,
        account_id: u128,
        amount: u64,
        timeout_seconds: u32,
        deadline: Instant,
        void_if_abandoned: bool,
    ) -> impl Future<Output = Result<HoldReply, LedgerError>> + Send;

    /// One pending debit per link as one linked chain: all placed, or none and the link that
    /// refused. `links` is not empty and has at most [`crate::ledger::CHAIN_LINKS_MAX`] links,
    /// none of amount 0.
    fn hold_chain(
        &self,
        links: Vec<ChainLink>,
        deadline: Instant,
        void_if_abandoned: bool,
    ) -> impl Future<Output = Result<ChainReply, LedgerError>> + Send;

    /// Voids a hold (its credit comes back now); `false` if it was no longer pending.
    fn void(
        &self,
        pending_id: u128,
        deadline: Instant,
    ) -> impl Future<Output = Result<bool, LedgerError>> + Send;

    /// Opens and credits the account, idempotently.
    fn provision(
        &self,
        account: &UserAccount,
        deadline: Instant,
    ) -> impl Future<Output = Result<(), LedgerError>> + Send;

    /// The account's credit and live holds; `None` if it does not exist.
    fn account_view(
        &self,
        account_id: u128,
        window_seconds_max: u32,
        deadline: Instant,
    ) -> impl Future<Output = Result<Option<AccountView>, LedgerError>> + Send;

    /// The account's free credit and whether it is closed, without listing its holds; `None` if
    /// it does not exist. By default, from [`Store::account_view`].
    fn account_free(
        &self,
        account_id: u128,
        window_seconds_max: u32,
        deadline: Instant,
    ) -> impl Future<Output = Result<Option<AccountFree>, LedgerError>> + Send {
        async move {
            let view = self
                .account_view(account_id, window_seconds_max, deadline)
                .await?;
            Ok(view.as_ref().map(AccountFree::from))
        }
    }

    /// Calls the store takes at once, at most (beyond them it answers `Overloaded`).
    fn in_flight_max(&self) -> usize {
        usize::MAX
    }

    /// Publishes what the store counts only when asked (its in-flight calls, its batches),
    /// before a scrape is rendered ([`super::Limiter::drain_counts`]).
    fn publish_at_scrape(&self) {}

    /// Whether the ledger answers at all.
    fn ping(&self, deadline: Instant) -> impl Future<Output = Result<(), LedgerError>> + Send;

    /// Counts an error the limiter found in the ledger's answers (the store counts its own).
    fn record_error(&self, error: &LedgerError);

    /// A lease: one pending debit of `units` for `timeout_seconds` (window + L), voided if it lands
    /// after the caller stopped waiting. Stores without leases refuse (plans then need none).
    fn take_lease(
        &self,
        _account_id: u128,
        _units: u64,
        _timeout_seconds: u32,
        _deadline: Instant,
    ) -> impl Future<Output = Result<HoldReply, LedgerError>> + Send {
        async { Err(no_leases()) }
    }

    /// Settles a lease: voids it and holds the units it admitted, atomically (a linked chain).
    fn settle_lease(
        &self,
        _settlement: Settlement,
        _deadline: Instant,
    ) -> impl Future<Output = Result<Settled, LedgerError>> + Send {
        async { Err(no_leases()) }
    }
}

fn no_leases() -> LedgerError {
    LedgerError::Unexpected {
        operation: Operation::CreateTransfers,
        message: "this store has no leases".to_owned(),
    }
}

impl Store for Ledger {
    fn ledger_id(&self) -> u32 {
        Ledger::ledger_id(self)
    }

    fn publish_at_scrape(&self) {
        Ledger::publish_at_scrape(self);
    }

    fn hold(
        &self,
        account_id: u128,
        amount: u64,
        timeout_seconds: u32,
        deadline: Instant,
        void_if_abandoned: bool,
    ) -> impl Future<Output = Result<HoldReply, LedgerError>> + Send {
        Ledger::hold(
            self,
            account_id,
            amount,
            timeout_seconds,
            deadline,
            void_if_abandoned,
        )
    }

    fn hold_chain(
        &self,
        links: Vec<ChainLink>,
        deadline: Instant,
        void_if_abandoned: bool,
    ) -> impl Future<Output = Result<ChainReply, LedgerError>> + Send {
        Ledger::hold_chain(self, links, deadline, void_if_abandoned)
    }

    fn provision(
        &self,
        account: &UserAccount,
        deadline: Instant,
    ) -> impl Future<Output = Result<(), LedgerError>> + Send {
        Ledger::provision(self, account, deadline)
    }

    fn void(
        &self,
        pending_id: u128,
        deadline: Instant,
    ) -> impl Future<Output = Result<bool, LedgerError>> + Send {
        Ledger::void(self, pending_id, deadline)
    }

    fn account_view(
        &self,
        account_id: u128,
        window_seconds_max: u32,
        deadline: Instant,
    ) -> impl Future<Output = Result<Option<AccountView>, LedgerError>> + Send {
        Ledger::account_view(self, account_id, window_seconds_max, deadline)
    }

    fn account_free(
        &self,
        account_id: u128,
        _window_seconds_max: u32,
        deadline: Instant,
    ) -> impl Future<Output = Result<Option<AccountFree>, LedgerError>> + Send {
        Ledger::account_free(self, account_id, deadline)
    }

    fn in_flight_max(&self) -> usize {
        Ledger::in_flight_max(self)
    }

    fn ping(&self, deadline: Instant) -> impl Future<Output = Result<(), LedgerError>> + Send {
        Ledger::ping(self, deadline)
    }

    fn record_error(&self, error: &LedgerError) {
        self.metrics().record_error(error.kind());
    }

    fn take_lease(
        &self,
        account_id: u128,
        units: u64,
        timeout_seconds: u32,
        deadline: Instant,
    ) -> impl Future<Output = Result<HoldReply, LedgerError>> + Send {
        Ledger::take_lease(self, account_id, units, timeout_seconds, deadline)
    }

    fn settle_lease(
        &self,
        settlement: Settlement,
        deadline: Instant,
    ) -> impl Future<Output = Result<Settled, LedgerError>> + Send {
        Ledger::settle_lease(self, settlement, deadline)
    }
}

/// Monotonic time for deadlines and expiries, wall time for the ledger's timestamps.
pub trait Clock: Send + Sync + 'static {
    fn now(&self) -> Instant;
    fn wall(&self) -> SystemTime;
}

/// The operating system's clocks.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn wall(&self) -> SystemTime {
        SystemTime::now()
    }
}
