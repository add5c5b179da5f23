//! Costs known only after the response: an admitted request's holds are replaced by holds of the
//! actual cost, for the rest of their windows, in one linked chain per request (void the estimate,
//! hold the actual), so the caller is never charged both or neither.

use std::time::Instant;

use tb::error::CreateTransferErrorKind;
use tigerbeetle_unofficial as tb;

use super::{model, unexpected_transfer, Ledger, LedgerError};

/// One hold to replace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recharge {
    pub pending_id: u128,
    pub account_id: u128,
    /// The actual cost. 0 gives everything back; more than the caller has free takes what it has
    /// (a balancing debit: the response is already sent, so the rest is forgiven).
    pub amount: u64,
    /// What is left of the original hold's window.
    pub timeout_seconds: u32,
}

/// What a recharge came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recharged {
    /// The new holds' ids, one per recharge (`None` for an actual cost of 0).
    Done(Vec<Option<u128>>),
    /// A hold had expired (the request outlived its window): nothing changed, nothing is owed.
    Expired,
    /// An account was closed meanwhile (an operator blocked or moved its caller): nothing
    /// changed, the estimate stands (the ledger voids a hold on a closed account but places
    /// none). An operator's doing, not a fault of the ledger.
    Closed,
}

impl Ledger {
    /// Replaces every hold of `recharges` by one of its actual cost, all in one linked chain.
    pub async fn recharge(
        &self,
        recharges: &[Recharge],
        deadline: Instant,
    ) -> Result<Recharged, LedgerError> {
        assert!(!recharges.is_empty() && recharges.len() <= super::CHAIN_LINKS_MAX);
        let mut chain = Vec::new();
        let mut ids = Vec::new();
        for recharge in recharges {
            chain.push(model::void_transfer(recharge.pending_id, self.ledger_id));
            if recharge.amount > 0 && recharge.timeout_seconds > 0 {
                // As much of the actual cost as the account has free.
                let (account, amount) = (recharge.account_id, recharge.amount);
                let timeout_seconds = recharge.timeout_seconds;
                let hold = model::balancing_hold_transfer(
                    account,
                    self.ledger_id,
                    amount,
                    timeout_seconds,
                );
                ids.push(Some(hold.id()));
                chain.push(hold);
            } else {
                ids.push(None);
            }
        }
        // Waits for a place under the in-flight bound: refused at once, a recharge that gives
        // back (a cost below the estimate) kept the estimate held, and one that charges more
        // left the request held for less than it cost.
        match self
            .create_chain(chain, (super::Place::Waited, deadline))
            .await?
        {
            None => Ok(Recharged::Done(ids)),
            Some(
                CreateTransferErrorKind::PendingTransferExpired
                | CreateTransferErrorKind::PendingTransferAlreadyVoided,
            ) => Ok(Recharged::Expired),
            Some(CreateTransferErrorKind::DebitAccountAlreadyClosed) => Ok(Recharged::Closed),
            Some(kind) => Err(unexpected_transfer("recharge: ", kind)),
        }
    }
}
