//! Giving back live holds of an account by amount, not by receipt: Envoy's `is_negative_hits`
//! (a request that ends gives its concurrency slot back, whichever instance placed it).
//!
//! Never below zero: only requests' holds still pending are voided (never an operator's block),
//! each whole, oldest first, and only while their amount fits in what is asked; a hold already
//! voided or expired answers so and gives nothing back. Two releases at once often choose the
//! same oldest holds, and one finds them voided: it reads again and voids others (at most
//! [`RELEASE_ROUNDS_MAX`] rounds), so concurrent releases do not leave slots taken until their
//! timeout. A release can give back less than asked (none left to give), never more.

use std::collections::HashSet;
use std::time::Instant;

use tb::error::CreateTransferErrorKind;
use tigerbeetle_unofficial as tb;

use super::metrics::Operation;
use super::{
    client_error, live_hold, model, nothing_if_abandoned, unexpected_transfer, Ledger, LedgerError,
    Place,
};

/// At most this many holds are voided by one release (one request's negative hits), in one
/// request to the ledger: what a development-mode ledger's 32 KiB request carries (less its
/// 256-byte header and, `create_transfers` being a multi-batch operation since 0.16, a trailer
/// padded to one 128-byte transfer). 254 were refused whole by the client (`TooMuchData`), and a
/// release of that many gave nothing back, however often it was asked.
pub const RELEASE_HOLDS_MAX: usize = 253;
/// At most this many reads and voids per release: more than one only when another release
/// voided the holds this one chose.
pub const RELEASE_ROUNDS_MAX: usize = 4;

/// What a release gave back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Released {
    /// Units given back (at most what was asked).
    pub units: u64,
    /// The account's available credit afterwards; `None` if the account does not exist, or
    /// could not be read again before the deadline.
    pub available: Option<u64>,
}

/// Holds from `pending` (oldest first) whose amounts add up to at most `left`, at most
/// `count_max` of them, none of those already `tried`: the oldest hold of exactly `left` if
/// there is one (a request gives back what it took, so its own hold is likely one such), else
/// the oldest that fit. Why the exact one first: with holds of 1 and then 5, a release of 5
/// took the 1 and skipped the 5 (too big for what was left), giving back 1; the later release
/// of 1 then found only the 5, and gave back nothing.
fn choose(
    pending: Vec<(u128, u64)>,
    mut left: u64,
    count_max: usize,
    tried: &HashSet<u128>,
) -> Vec<(u128, u64)> {
    let untried = |(id, _): &&(u128, u64)| !tried.contains(id);
    if count_max == 0 {
        return Vec::new();
    }
    if let Some(exact) = pending.iter().filter(untried).find(|(_, a)| *a == left) {
        return vec![*exact];
    }
    let mut chosen = Vec::new();
    for (id, amount) in pending {
        if chosen.len() == count_max || left == 0 {
            break;
        }
        if amount <= left && !tried.contains(&id) {
            left -= amount;
            chosen.push((id, amount));
        }
    }
    chosen
}

impl Ledger {
    /// Voids live holds of `account_id` adding up to at most `units`, oldest first.
    pub async fn release_units(
        &self,
        account_id: u128,
        units: u64,
        window_seconds: u32,
        deadline: Instant,
    ) -> Result<Released, LedgerError> {
        let mut released = 0;
        let mut tried = HashSet::new();
        for _ in 0..RELEASE_ROUNDS_MAX {
            let left = units - released;
            if left == 0 || tried.len() >= RELEASE_HOLDS_MAX {
                break;
            }
            let pending = self
                .pending_holds(account_id, window_seconds, deadline)
                .await?;
            let chosen = choose(pending, left, RELEASE_HOLDS_MAX - tried.len(), &tried);
            if chosen.is_empty() {
                break;
            }
            tried.extend(chosen.iter().map(|(id, _)| *id));
            let asked: u64 = chosen.iter().map(|(_, amount)| amount).sum();
            let gave = self.void_all(chosen, deadline).await?;
            released += gave;
            assert!(released <= units, "released {released} of {units}");
            // Every hold chosen was voided: what the listing had that fits is given back, and
            // another listing would find no more (it read the account again for nothing, up to
            // 16 pages, each waiting for a place). Only holds another release voided first call
            // for another round.
            if gave == asked {
                break;
            }
        }
        // Best effort: the voids above landed whether or not this read has time left.
        let account = self.lookup_account(account_id, deadline).await;
        let available = account.ok().flatten().map(|a| {
            let credit = a.credits_posted().saturating_sub(a.debits_posted());
            u64::try_from(credit.saturating_sub(a.debits_pending())).unwrap_or(u64::MAX)
        });
        Ok(Released {
            units: released,
            available,
        })
    }

    /// The account's requests' holds not voided nor expired, oldest first, as (id, amount).
    ///
    /// Read newest first ([`Ledger::unresolved_holds`]), as the account's listing is: the live
    /// holds (the newest) are read before the cap, each with its void if any. Read oldest first,
    /// a busy account's cap was reached among holds voided long ago, whose voids were past it:
    /// they looked live, each void of them gave nothing back, and a concurrency limit's slots
    /// stayed taken until their window ended.
    async fn pending_holds(
        &self,
        account_id: u128,
        window_seconds: u32,
        deadline: Instant,
    ) -> Result<Vec<(u128, u64)>, LedgerError> {
        // A request's hold: an operator's block is pending too, and not the caller's; nor is an
        // over-charge (what remained of a refused charge), which the audit counts apart: voided
        // here, it was counted as a request's void, one admitted request short.
        let request_hold = |transfer: &tb::Transfer, now| {
            let (id, hold) = live_hold(transfer, now)?;
            let request = transfer.code() == model::TRANSFER_CODE_REQUEST
                && transfer.user_data_32() != model::OVER_CHARGE_USER_DATA_32;
            request.then_some((id, hold.amount))
        };
        let (mut holds, _) = self
            .unresolved_holds(
                account_id,
                window_seconds,
                (Place::Waited, deadline),
                request_hold,
            )
            .await?;
        holds.reverse();
        Ok(holds)
    }

    /// Voids each hold (independent events, not a chain: one that expired meanwhile must not
    /// keep the others); the units of those actually voided.
    async fn void_all(
        &self,
        holds: Vec<(u128, u64)>,
        deadline: Instant,
    ) -> Result<u64, LedgerError> {
        let ledger_id = self.ledger_id;
        self.call_placed(
            Operation::CreateTransfers,
            (Place::Waited, deadline),
            move |client| async move {
                let voids: Vec<tb::Transfer> = holds
                    .iter()
                    .map(|(id, _)| model::void_transfer(*id, ledger_id))
                    .collect();
                let mut released: u64 = holds.iter().map(|(_, amount)| amount).sum();
                match client.create_transfers(voids).await {
                    Ok(()) => {}
                    Err(tb::error::CreateTransfersError::Api(errors)) => {
                        for error in errors.as_slice() {
                            match error.kind() {
                                CreateTransferErrorKind::PendingTransferExpired
                                | CreateTransferErrorKind::PendingTransferAlreadyVoided => {}
                                kind => return Err(unexpected_transfer("release: ", kind)),
                            }
                            let index = usize::try_from(error.index()).unwrap_or(usize::MAX);
                            let amount = holds.get(index).map_or(0, |(_, amount)| *amount);
                            released = released.saturating_sub(amount);
                        }
                    }
                    Err(e) => return Err(client_error(Operation::CreateTransfers, e)),
                }
                Ok(released)
            },
            nothing_if_abandoned(),
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hold_of_exactly_the_amount_is_chosen_first() {
        let none = HashSet::new();
        let pending = vec![(1, 1), (2, 5), (3, 5)];
        assert_eq!(choose(pending.clone(), 5, 10, &none), [(2, 5)]);
        // Else the oldest that fit, whole.
        assert_eq!(choose(pending.clone(), 4, 10, &none), [(1, 1)]);
        assert_eq!(
            choose(pending.clone(), 11, 10, &none),
            [(1, 1), (2, 5), (3, 5)]
        );
        // Never one tried already, never more than `count_max`.
        let tried = HashSet::from([2]);
        assert_eq!(choose(pending.clone(), 5, 10, &tried), [(3, 5)]);
        assert_eq!(choose(pending.clone(), 11, 1, &none), [(1, 1)]);
        assert!(choose(pending, 5, 0, &none).is_empty());
    }
}
