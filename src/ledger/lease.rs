//! Leases in the ledger: one pending transfer of `units` that an instance admits a hot caller's
//! requests from in memory, and its settlement, one linked chain that voids the lease and holds
//! exactly the units it admitted.
//!
//! Audit trail (documented in the README): a lease is a pending debit with code
//! [`TRANSFER_CODE_LEASE`]; its settlement is the void of the lease (code [`TRANSFER_CODE_LEASE`],
//! `user_data_64` = requests the lease admitted, `user_data_32` = units they used) linked with a
//! pending debit of exactly those units (code [`TRANSFER_CODE_LEASE_SETTLEMENT`], `user_data_64` =
//! the same request count, `user_data_128` = the lease's id). A lease whose instance died is never
//! voided: it expires on its own, window + L after it was placed.

use std::time::Instant;

use tb::error::CreateTransferErrorKind;
use tigerbeetle_unofficial as tb;

use super::metrics::Operation;
use super::{client_error, model, nothing_if_abandoned, HoldReply, Ledger, LedgerError};

/// A lease: a pending debit of the leased units, timeout = window + L.
pub const TRANSFER_CODE_LEASE: u16 = 9;
/// A settlement's hold of the units a lease admitted, timeout = the window (less the whole seconds
/// since its first try, for one sent again: `Settlement::window_seconds`).
pub const TRANSFER_CODE_LEASE_SETTLEMENT: u16 = 10;

/// What a lease admitted, to settle it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settlement {
    pub account_id: u128,
    pub lease_id: u128,
    /// Units admitted from the lease: held again, exactly, for `window_seconds`.
    pub units_used: u64,
    /// Requests admitted from the lease (the audit trail records it).
    pub requests: u64,
    /// The settlement hold's timeout: the window, less the whole seconds since the
    /// settlement's first try for one sent again (at least 1).
    pub window_seconds: u32,
}

/// How a settlement ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    /// The lease is void and its used units are held for `Settlement::window_seconds` from now.
    Done,
    /// The lease had expired (or was voided already): nothing was changed. It expires window + L
    /// after it was placed, and nothing was admitted from it after L, so its units are out of
    /// every window that needs them.
    LeaseGone,
    /// The account is closed (an operator's block, or a move): the lease could be voided but
    /// its used units not held again, so the chain changed nothing. The lease holds on until its
    /// timeout (window + L after it was placed): every admitted unit stays held long enough, and
    /// the unused ones come back then rather than now.
    AccountClosed,
}

pub fn lease_transfer(
    account_id: u128,
    ledger: u32,
    units: u64,
    timeout_seconds: u32,
) -> tb::Transfer {
    model::hold_transfer(account_id, ledger, units, timeout_seconds).with_code(TRANSFER_CODE_LEASE)
}

/// The settlement chain: [void the lease, hold the units used] linked, so both happen or neither
/// does (no instant without the admitted units held). Only the void when nothing was used.
pub fn settlement_transfers(settlement: &Settlement, ledger: u32) -> Vec<tb::Transfer> {
    // A lease has at most 2^32 - 1 units (`Plan::with_lease`): the audit's count is exact.
    let units_used = u32::try_from(settlement.units_used).expect("lease units fit in 32 bits");
    let void = model::void_transfer(settlement.lease_id, ledger)
        .with_code(TRANSFER_CODE_LEASE)
        .with_user_data_64(settlement.requests)
        .with_user_data_32(units_used);
    if settlement.units_used == 0 {
        return vec![void];
    }
    let hold = model::hold_transfer(
        settlement.account_id,
        ledger,
        settlement.units_used,
        settlement.window_seconds,
    )
    .with_code(TRANSFER_CODE_LEASE_SETTLEMENT)
    .with_user_data_64(settlement.requests)
    .with_user_data_128(settlement.lease_id);
    let void =
        void.with_flags(tb::transfer::Flags::VOID_PENDING_TRANSFER | tb::transfer::Flags::LINKED);
    vec![void, hold]
}

impl Ledger {
    /// Places a lease of `units` for `timeout_seconds` (window + L). A lease that lands after its
    /// caller stopped waiting is voided: nobody admits from it.
    pub async fn take_lease(
        &self,
        account_id: u128,
        units: u64,
        timeout_seconds: u32,
        deadline: Instant,
    ) -> Result<HoldReply, LedgerError> {
        let transfer = lease_transfer(account_id, self.ledger_id, units, timeout_seconds);
        self.place_pending(transfer, deadline, true).await
    }

    /// Settles a lease in one linked chain. An error leaves the outcome unknown, which is safe
    /// either way: the lease, or the settlement, holds every admitted unit long enough. Refused
    /// at once under a full in-flight bound, as decisions are: a renewal settles on its
    /// request's path, which must fail fast (a refused settlement leaves the lease to expire,
    /// window + L: more held, never less).
    pub async fn settle_lease(
        &self,
        settlement: Settlement,
        deadline: Instant,
    ) -> Result<Settled, LedgerError> {
        let transfers = settlement_transfers(&settlement, self.ledger_id);
        self.call(
            Operation::CreateTransfers,
            deadline,
            move |client| async move {
                match client.create_transfers(transfers).await {
                    Ok(()) => Ok(Settled::Done),
                    Err(tb::error::CreateTransfersError::Api(errors)) => {
                        settlement_refused(errors.as_slice().iter().map(|e| (e.index(), e.kind())))
                    }
                    Err(e) => Err(client_error(Operation::CreateTransfers, e)),
                }
            },
            nothing_if_abandoned(),
        )
        .await
    }
}

/// A refused settlement chain: the lease gone (expired or voided), or its account closed, is an
/// answer, anything else is an error. The hold of the used units fails on a closed account
/// (`debit_account_already_closed`: voids are allowed there, new debits are not), and the void
/// with it (`linked_event_failed`).
fn settlement_refused(
    errors: impl Iterator<Item = (u32, CreateTransferErrorKind)>,
) -> Result<Settled, LedgerError> {
    use CreateTransferErrorKind as K;
    let errors: Vec<(u32, K)> = errors.collect();
    let kind_of = |at: u32| errors.iter().find(|(index, _)| *index == at).map(|e| e.1);
    match (kind_of(0), kind_of(1)) {
        (None, _) => Err(super::no_event_error(Operation::CreateTransfers)),
        (Some(K::PendingTransferExpired | K::PendingTransferAlreadyVoided), _) => {
            Ok(Settled::LeaseGone)
        }
        (Some(K::LinkedEventFailed), Some(K::DebitAccountAlreadyClosed)) => {
            Ok(Settled::AccountClosed)
        }
        (Some(kind), _) => Err(super::unexpected_transfer("settlement: ", kind)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settlement_is_linked_and_records_what_the_lease_covered() {
        let settlement = Settlement {
            account_id: 7 | 1 << 127,
            lease_id: 99,
            units_used: 12,
            requests: 10,
            window_seconds: 30,
        };
        let chain = settlement_transfers(&settlement, model::LEDGER_REQUEST_RATE);
        assert_eq!(chain.len(), 2);
        assert!(chain[0].flags().contains(tb::transfer::Flags::LINKED));
        assert!(chain[0]
            .flags()
            .contains(tb::transfer::Flags::VOID_PENDING_TRANSFER));
        assert_eq!(chain[0].pending_id(), 99);
        assert_eq!((chain[0].user_data_64(), chain[0].user_data_32()), (10, 12));
        assert!(
            !chain[1].flags().contains(tb::transfer::Flags::LINKED),
            "the chain ends"
        );
        assert_eq!(chain[1].amount(), 12);
        assert_eq!(chain[1].timeout(), 30);
        assert_eq!(
            (chain[1].user_data_64(), chain[1].user_data_128()),
            (10, 99)
        );
        let unused = Settlement {
            units_used: 0,
            requests: 0,
            ..settlement
        };
        let chain = settlement_transfers(&unused, model::LEDGER_REQUEST_RATE);
        assert_eq!(chain.len(), 1);
        assert!(!chain[0].flags().contains(tb::transfer::Flags::LINKED));
    }

    #[test]
    fn a_gone_lease_is_an_answer_and_other_refusals_are_errors() {
        use CreateTransferErrorKind as K;
        let gone = [(0, K::PendingTransferExpired), (1, K::LinkedEventFailed)];
        assert_eq!(settlement_refused(gone.into_iter()), Ok(Settled::LeaseGone));
        let voided = [(0, K::PendingTransferAlreadyVoided)];
        assert_eq!(
            settlement_refused(voided.into_iter()),
            Ok(Settled::LeaseGone)
        );
        let closed = [(0, K::LinkedEventFailed), (1, K::DebitAccountAlreadyClosed)];
        assert_eq!(
            settlement_refused(closed.into_iter()),
            Ok(Settled::AccountClosed)
        );
        let odd = [(0, K::LinkedEventFailed), (1, K::ExceedsCredits)];
        assert!(settlement_refused(odd.into_iter()).is_err());
        assert!(settlement_refused(std::iter::empty()).is_err());
    }
}
