//! Costs known only after the response (a handler that reports what a request really cost, such
//! as tokens generated or bytes sent): the admitted request's holds are replaced by holds of the
//! actual cost for the rest of their windows ([`Ledger::recharge`]).

use std::time::Instant;

use super::local_view::LocalRecharge;
use super::store::Clock;
use super::{whole_seconds_up, Decision, HoldReceipt, Limiter};
use crate::ledger::settle::{Recharge, Recharged};
use crate::ledger::{Ledger, LedgerError};

impl Limiter {
    /// Charges `actual` instead of what the request held, on the plan and every route limit
    /// whose hold still lives: which were recharged, one flag per hold of
    /// [`Decision::holds`] as it was (none when there was nothing to recharge: no hold, or the
    /// same cost). The decision's quotas (its `RateLimit` fields) say what the caller has left
    /// after it, never more than this instance's view holds free; its receipts are the new
    /// holds', so a refund after a recharge gives back what the recharge held.
    ///
    /// A hold whose window is over is left out: it has nothing left to charge, and its void
    /// (`pending_transfer_expired`) failed the one linked chain of every hold, so a request that
    /// outlived a per-second limit's window was charged its estimate on its daily limit too.
    pub async fn recharge(
        &self,
        decision: &mut Decision<'_>,
        actual: u64,
    ) -> Result<Vec<bool>, LedgerError> {
        let Some(plan_hold) = decision.hold else {
            return Ok(Vec::new());
        };
        if plan_hold.amount == actual {
            return Ok(Vec::new());
        }
        let now = self.clock.now();
        let margin = self.settings.expiry_margin;
        let holds: Vec<(u128, HoldReceipt)> = decision.holds().collect();
        let recharges: Vec<Option<Recharge>> = holds
            .iter()
            .map(|&(account_id, hold)| {
                // What is left of the hold's window (its expiry, less the local margin).
                let left = hold.expires_at.saturating_duration_since(now + margin);
                (!left.is_zero()).then(|| Recharge {
                    pending_id: hold.transfer_id,
                    account_id,
                    amount: actual,
                    timeout_seconds: u32::try_from(whole_seconds_up(left)).unwrap_or(u32::MAX),
                })
            })
            .collect();
        let live: Vec<Recharge> = recharges.iter().flatten().copied().collect();
        let accounts: Vec<u128> = live.iter().map(|recharge| recharge.account_id).collect();
        let dropped = super::ForgetIfDropped::new(&self.local, accounts);
        let mut live_replaced = match live.is_empty() {
            true => Vec::new(),
            false => self.recharge_live(&live, now).await?,
        }
        .into_iter();
        dropped.disarm();
        let replaced: Vec<Option<Option<u128>>> = recharges
            .iter()
            .map(|recharge| recharge.and_then(|_| live_replaced.next().expect("one per live hold")))
            .collect();
        for (&(account_id, hold), _) in holds.iter().zip(&replaced).filter(|(_, new)| new.is_some())
        {
            let old = LocalRecharge {
                amount: hold.amount,
                expires_at: hold.expires_at,
            };
            self.local.recharge(account_id, old, actual, now);
        }
        decision.recharged(actual, &replaced);
        self.within_view(decision);
        Ok(replaced.iter().map(Option::is_some).collect())
    }

    /// Recharges every hold of `live` in one linked chain; if one of them expired at the ledger
    /// all the same (inside the expiry margin), or its account was closed, each alone, so that
    /// the others still are. One entry per hold: `None` if it was left as it was, else its new
    /// hold's transfer (`None` for a cost of 0).
    async fn recharge_live(
        &self,
        live: &[Recharge],
        now: Instant,
    ) -> Result<Vec<Option<Option<u128>>>, LedgerError> {
        let deadline = now + self.settings.ledger_timeout;
        let ledger: &Ledger = &self.store;
        match ledger.recharge(live, deadline).await {
            Ok(Recharged::Done(ids)) => return Ok(ids.into_iter().map(Some).collect()),
            Ok(Recharged::Expired | Recharged::Closed) => {}
            Err(error) => {
                // Landed or not, unknown: the view forgets these callers rather than count the
                // old holds on (a recharge that landed may have left more free, or less).
                for recharge in live {
                    self.local.forget(recharge.account_id);
                }
                return Err(error);
            }
        }
        let alone = live.iter().map(|recharge| async move {
            match ledger
                .recharge(std::slice::from_ref(recharge), deadline)
                .await
            {
                Ok(Recharged::Done(ids)) => Some(ids[0]),
                Ok(Recharged::Expired) => None,
                Ok(Recharged::Closed) => {
                    // Its next request finds out why (a block, or where it moved).
                    self.local.forget(recharge.account_id);
                    None
                }
                Err(error) => {
                    // Landed or not, unknown: as for the chain above.
                    self.local.forget(recharge.account_id);
                    tracing::debug!(%error, "could not recharge a hold; its estimate stands");
                    None
                }
            }
        });
        Ok(futures_util::future::join_all(alone).await)
    }
}
