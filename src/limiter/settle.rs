//! Costs known only after the response (a handler that reports what a request really cost, such
//! as tokens generated or bytes sent): the admitted request's holds are replaced by holds of the
//! actual cost for the rest of their windows ([`Ledger::recharge`]).

use super::local_view::LocalRecharge;
use super::store::Clock;
use super::{whole_seconds_up, Decision, HoldReceipt, Limiter};
use crate::ledger::settle::{Recharge, Recharged};
use crate::ledger::{Ledger, LedgerError};

impl Limiter {
    /// Charges `actual` instead of what the request held, on the plan and every route limit.
    /// `Ok(false)` when there was nothing to recharge (no hold, the same cost, or it expired).
    pub async fn recharge(
        &self,
        decision: &Decision<'_>,
        actual: u64,
    ) -> Result<bool, LedgerError> {
        let Some(plan_hold) = decision.hold else {
            return Ok(false);
        };
        if plan_hold.amount == actual {
            return Ok(false);
        }
        let now = self.clock.now();
        let margin = self.settings.expiry_margin;
        let recharges: Vec<Recharge> = decision
            .holds()
            .map(|(account_id, hold): (u128, HoldReceipt)| {
                // What is left of the hold's window (its expiry, less the local margin).
                let left = hold.expires_at.saturating_duration_since(now + margin);
                Recharge {
                    pending_id: hold.transfer_id,
                    account_id,
                    amount: actual,
                    timeout_seconds: u32::try_from(whole_seconds_up(left)).unwrap_or(u32::MAX),
                }
            })
            .collect();
        let deadline = now + self.settings.ledger_timeout;
        let ledger: &Ledger = &self.store;
        match ledger.recharge(&recharges, deadline).await? {
            Recharged::Expired => Ok(false),
            Recharged::Done(_) => {
                for (account_id, hold) in decision.holds() {
                    let old = LocalRecharge {
                        amount: hold.amount,
                        expires_at: hold.expires_at,
                    };
                    self.local.recharge(account_id, old, actual, now);
                }
                Ok(true)
            }
        }
    }
}
