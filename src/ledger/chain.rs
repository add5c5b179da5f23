//! Several holds as one TigerBeetle **linked chain**: either every hold is placed or none is.
//!
//! A request limited on several dimensions at once (per minute and per hour, per user and per
//! route, ...) must not consume credit on one limit when another refuses it: a denied request
//! consumes nothing anywhere. TigerBeetle applies a chain of events flagged `linked` atomically; the
//! first event that fails reports its own result and every other event of the chain reports
//! `linked_event_failed`. So the reply names the one link that refused, and why.

use std::sync::Arc;
use std::time::Instant;

use tb::error::CreateTransferErrorKind;
use tigerbeetle_unofficial as tb;

use super::metrics::Operation;
use super::{
    client_error, model, no_event_error, unexpected_transfer, Connection, Ledger, LedgerError,
    Roundtrip,
};

/// At most this many holds in one chain. A decision with more limits than this is a configuration
/// or input error the front end reports; TigerBeetle itself would take ~8,000 (254 in
/// `--development` mode), but a request limited on more than a few dozen dimensions is a mistake.
pub const CHAIN_LINKS_MAX: usize = 64;

/// One hold of a chain: a pending debit of `amount` on `account_id`, released after
/// `timeout_seconds`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChainLink {
    pub account_id: u128,
    /// Never zero: a limit that costs nothing is no link (the limiter leaves it out).
    pub amount: u64,
    pub timeout_seconds: u32,
}

/// Why one link of a chain refused, so that nothing of the chain was placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkRefusal {
    /// `exceeds_credits`: that account's credit is all held.
    ExceedsCredits,
    /// `debit_account_not_found`: a new caller on that limit; provision it, then try again.
    AccountNotFound,
    /// `debit_account_already_closed`: an operator blocked (or moved) that account's caller.
    Closed,
}

/// The ledger's answer to a chain of holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChainReply {
    /// Every hold was placed. `transfer_ids[i]` is link `i`'s pending transfer (to void it);
    /// `roundtrip` is the chain's, as [`super::HoldReply::Held`]'s.
    Held {
        roundtrip: Roundtrip,
        transfer_ids: Vec<u128>,
    },
    /// Link `index` refused; no hold of the chain was placed.
    Refused { index: usize, refusal: LinkRefusal },
}

impl Ledger {
    /// Places one pending debit per link as one linked chain: one round trip, all or nothing.
    ///
    /// With `void_if_abandoned`, a chain the ledger placed after the caller stopped waiting is
    /// voided when its answer arrives (as [`Ledger::hold`] does for one hold).
    pub async fn hold_chain(
        &self,
        links: Vec<ChainLink>,
        deadline: Instant,
        void_if_abandoned: bool,
    ) -> Result<ChainReply, LedgerError> {
        assert!(!links.is_empty() && links.len() <= CHAIN_LINKS_MAX);
        let transfers = chain_transfers(&links, self.ledger_id);
        let transfer_ids: Vec<u128> = transfers.iter().map(|t| t.id()).collect();
        let ledger_id = self.ledger_id;
        let abandoned_ids = transfer_ids.clone();
        let on_abandoned =
            move |connection: Arc<Connection>, outcome: &Result<ChainReply, LedgerError>| {
                if void_if_abandoned && matches!(outcome, Ok(ChainReply::Held { .. })) {
                    let voids: Vec<tb::Transfer> = abandoned_ids
                        .iter()
                        .map(|id| model::void_transfer(*id, ledger_id))
                        .collect();
                    connection.void_abandoned_later(voids);
                }
            };
        self.call(
            Operation::CreateTransfers,
            deadline,
            move |client| async move {
                let sent_at = Instant::now();
                match client.create_transfers(transfers).await {
                    Ok(()) => Ok(ChainReply::Held {
                        roundtrip: Roundtrip {
                            sent_at,
                            answered_at: Instant::now(),
                        },
                        transfer_ids,
                    }),
                    Err(tb::error::CreateTransfersError::Api(errors)) => {
                        let failed = errors.as_slice().iter().map(|e| (e.index(), e.kind()));
                        refused_link(failed)
                    }
                    Err(e) => Err(client_error(Operation::CreateTransfers, e)),
                }
            },
            Some(on_abandoned),
        )
        .await
    }
}

/// The holds of a chain: every one but the last flagged `linked` (the last one closes the chain).
pub fn chain_transfers(links: &[ChainLink], ledger_id: u32) -> Vec<tb::Transfer> {
    let last = links.len().saturating_sub(1);
    links
        .iter()
        .enumerate()
        .map(|(index, link)| {
            let hold = model::hold_transfer(
                link.account_id,
                ledger_id,
                link.amount,
                link.timeout_seconds,
            );
            if index < last {
                hold.with_flags(hold.flags() | tb::transfer::Flags::LINKED)
            } else {
                hold
            }
        })
        .collect()
}

/// The one link that failed for a reason of its own (the others answer `linked_event_failed`).
fn refused_link(
    failed: impl Iterator<Item = (u32, CreateTransferErrorKind)>,
) -> Result<ChainReply, LedgerError> {
    let mut cause = None;
    for (index, kind) in failed {
        if !matches!(kind, CreateTransferErrorKind::LinkedEventFailed) {
            if cause.is_some() {
                // One chain fails at one event; two causes would mean it was not one chain.
                return Err(unexpected_transfer("chain with two failed links: ", kind));
            }
            cause = Some((index, kind));
        }
    }
    let Some((index, kind)) = cause else {
        return Err(no_event_error(Operation::CreateTransfers));
    };
    let refusal = match kind {
        CreateTransferErrorKind::ExceedsCredits => LinkRefusal::ExceedsCredits,
        CreateTransferErrorKind::DebitAccountNotFound => LinkRefusal::AccountNotFound,
        CreateTransferErrorKind::DebitAccountAlreadyClosed => LinkRefusal::Closed,
        kind => return Err(unexpected_transfer("chain: ", kind)),
    };
    let index = usize::try_from(index).expect("u32 fits in usize");
    Ok(ChainReply::Refused { index, refusal })
}

#[cfg(test)]
mod tests {
    use super::*;
    use CreateTransferErrorKind::{DebitAccountNotFound, ExceedsCredits, LinkedEventFailed};

    fn link(account_id: u128) -> ChainLink {
        ChainLink {
            account_id,
            amount: 1,
            timeout_seconds: 60,
        }
    }

    #[test]
    fn every_link_but_the_last_is_linked() {
        let transfers = chain_transfers(&[link(1 << 127), link(2 << 126), link(3 << 126)], 1);
        let linked: Vec<bool> = transfers
            .iter()
            .map(|t| t.flags().contains(tb::transfer::Flags::LINKED))
            .collect();
        assert_eq!(linked, [true, true, false]);
        assert!(transfers
            .iter()
            .all(|t| t.flags().contains(tb::transfer::Flags::PENDING)));
        let single = chain_transfers(&[link(1 << 127)], 1);
        assert!(!single[0].flags().contains(tb::transfer::Flags::LINKED));
    }

    #[test]
    fn the_refusing_link_is_the_one_not_failed_by_the_chain() {
        let reply = refused_link(
            [
                (0, LinkedEventFailed),
                (1, ExceedsCredits),
                (2, LinkedEventFailed),
            ]
            .into_iter(),
        );
        assert_eq!(
            reply,
            Ok(ChainReply::Refused {
                index: 1,
                refusal: LinkRefusal::ExceedsCredits
            })
        );
        let reply = refused_link([(0, DebitAccountNotFound), (1, LinkedEventFailed)].into_iter());
        assert_eq!(
            reply,
            Ok(ChainReply::Refused {
                index: 0,
                refusal: LinkRefusal::AccountNotFound
            })
        );
    }

    #[test]
    fn answers_the_model_does_not_expect_are_errors() {
        assert!(refused_link([(0, LinkedEventFailed)].into_iter()).is_err());
        assert!(refused_link([(0, ExceedsCredits), (1, ExceedsCredits)].into_iter()).is_err());
        assert!(refused_link([(0, CreateTransferErrorKind::Exists)].into_iter()).is_err());
        assert!(refused_link(std::iter::empty()).is_err());
    }
}
