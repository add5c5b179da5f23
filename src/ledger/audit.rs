//! The audit of one user account, read back from the ledger itself: what it was granted and what
//! its requests hold. An operator runs it against a live cluster (`ledger-limiter audit`); the
//! fault tests run it after every case to show that nothing was lost or counted twice.

use std::time::{Instant, SystemTime};

use serde::Serialize;
use tigerbeetle_unofficial as tb;

use super::{model, Ledger, LedgerError, Place, TRANSFERS_PAGE_LIMIT};

/// How many pages an audit reads at most (about a million transfers); beyond, it says it is
/// incomplete rather than reading without end.
pub const AUDIT_PAGES_MAX: usize = 4096;

/// How many of the account's latest transfers an audit lists.
pub const RECENT_TRANSFERS_MAX: usize = 20;

/// One transfer of the account, as an operator reads it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TransferSummary {
    /// Hex.
    pub id: String,
    /// What it is: `grant`, `hold`, `void`, `top_up`, `reduction`, `block`, `unblock`, `move`,
    /// `move_back`, `carried`, `lease`, `lease_settled`, `settlement` (or `code_<n>` for a code this
    /// version does not know).
    pub kind: String,
    pub amount: u128,
    /// Nanoseconds since the UNIX epoch (the ledger's clock).
    pub timestamp_ns: u64,
    /// A pending transfer's timeout (0 for the others).
    pub timeout_seconds: u32,
}

/// One account, as the ledger records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AccountAudit {
    /// Hex, as in traces (`user.id`).
    pub account_id: String,
    /// The plan's capacity and window when the account was opened (`user_data_64`, `_32`).
    pub capacity: u64,
    pub window_seconds: u32,
    /// Credit not held now: credits_posted − debits_posted − debits_pending.
    pub available: u128,
    pub credits_posted: u128,
    pub debits_posted: u128,
    /// Credit held by holds not yet expired, voided or posted.
    pub debits_pending: u128,
    /// Grant transfers: exactly one for a provisioned caller (credited once).
    pub grants: u64,
    /// Pending debits ever placed: one per admitted request (and per hold whose request was
    /// refused at its deadline, each then voided).
    pub holds: u64,
    /// The Envoy front end's holds of what remained of a charge that did not fit (code 2,
    /// `user_data_32` = [`model::OVER_CHARGE_USER_DATA_32`]), one per such refused request on
    /// each of its descriptors' accounts (the one that refused, and the call's others: their
    /// charge as far as it went): not in `holds`, which stays the requests placed (and
    /// recharges, each with its void).
    pub over_charges: u64,
    /// Holds voided: their request had been refused when they landed, or was refunded.
    pub voids: u64,
    /// Operators' reductions of the credit (admin API).
    pub reductions: u64,
    /// Operators' top-ups of the credit (admin API).
    pub top_ups: u64,
    /// Operators' blocks, and the ones ended early (admin API).
    pub blocks: u64,
    pub unblocks: u64,
    /// Moves of the caller away from this account (closing it for good), and back to it.
    pub moves_out: u64,
    pub moves_back: u64,
    /// Holds carried here from the account of the plan the caller moved from.
    pub carried_in: u64,
    /// Whether the account is closed now (by a block, or by a move away from it).
    pub blocked: bool,
    /// Lease mode: leases placed (code 9, pending), leases settled (their void, code 9), the
    /// requests those settled leases admitted (the voids' `user_data_64`), and settlement holds
    /// (code 10). A lease never settled (its instance died) expired with its count unrecorded.
    pub leases: u64,
    pub leases_settled: u64,
    pub lease_requests: u64,
    pub lease_settlements: u64,
    /// Transfers counted; `complete` is false when there were more than the audit reads (by its
    /// page bound or its deadline): the counts above are then those of the oldest
    /// `transfers_read`, and the balances are whole all the same.
    pub transfers_read: u64,
    /// The latest transfers (at most [`RECENT_TRANSFERS_MAX`]), oldest first.
    pub recent: Vec<TransferSummary>,
    pub complete: bool,
    /// The configured plan with this account's capacity and window, when exactly one has them
    /// (the ledger records those, not the plan's name); filled in by whoever knows the plans.
    pub plan: Option<String>,
}

impl AccountAudit {
    /// Holds that count as admitted requests: placed and not voided (lease plans: plus
    /// `lease_requests`).
    pub fn admitted(&self) -> u64 {
        self.holds.saturating_sub(self.voids) + self.lease_requests
    }
}

impl Ledger {
    /// Reads the account, its latest transfers and every transfer on it (bounded by
    /// [`AUDIT_PAGES_MAX`] pages and by `deadline`: `complete` says whether all were counted).
    /// `None` if the account does not exist.
    pub async fn audit(
        &self,
        account_id: u128,
        deadline: Instant,
    ) -> Result<Option<AccountAudit>, LedgerError> {
        self.audit_if(account_id, deadline, |_| true).await
    }

    /// [`Ledger::audit`] of a caller's account on this handle's ledger, `None` for any other
    /// (a concurrency limit's slots, on another ledger, has a caller's kind of id too): the
    /// admin API answered 200 with a made-up caller's audit for one.
    pub async fn audit_caller(
        &self,
        account_id: u128,
        deadline: Instant,
    ) -> Result<Option<AccountAudit>, LedgerError> {
        let is_caller = |account: &tb::Account| self.is_callers(account);
        self.audit_if(account_id, deadline, is_caller).await
    }

    async fn audit_if(
        &self,
        account_id: u128,
        deadline: Instant,
        wanted: impl Fn(&tb::Account) -> bool,
    ) -> Result<Option<AccountAudit>, LedgerError> {
        let account = self.lookup_account(account_id, deadline).await?;
        let Some(account) = account.filter(|account| wanted(account)) else {
            return Ok(None);
        };
        let mut audit = AccountAudit {
            account_id: format!("{account_id:032x}"),
            capacity: account.user_data_64(),
            window_seconds: account.user_data_32(),
            available: super::credit_and_available(&account).1,
            credits_posted: account.credits_posted(),
            debits_posted: account.debits_posted(),
            debits_pending: account.debits_pending(),
            grants: 0,
            holds: 0,
            over_charges: 0,
            voids: 0,
            reductions: 0,
            top_ups: 0,
            blocks: 0,
            unblocks: 0,
            moves_out: 0,
            moves_back: 0,
            carried_in: 0,
            blocked: account.flags().contains(tb::account::Flags::CLOSED),
            leases: 0,
            leases_settled: 0,
            lease_requests: 0,
            lease_settlements: 0,
            transfers_read: 0,
            recent: Vec::new(),
            complete: false,
            plan: None,
        };
        audit.recent = self.recent_transfers(account_id, deadline).await?;
        self.count_transfers(&mut audit, account_id, deadline)
            .await?;
        Ok(Some(audit))
    }

    /// The account's latest transfers (at most [`RECENT_TRANSFERS_MAX`]), oldest first: one page
    /// read newest first, so that an audit whose count is cut short still lists the latest.
    async fn recent_transfers(
        &self,
        account_id: u128,
        deadline: Instant,
    ) -> Result<Vec<TransferSummary>, LedgerError> {
        use tb::account::FilterFlags as F;
        let filter = tb::account::Filter::new(account_id, RECENT_TRANSFERS_MAX as u32)
            .with_flags(F::DEBITS | F::CREDITS | F::REVERSED);
        let page = self
            .account_transfers(filter, (Place::AtOnce, deadline))
            .await?;
        Ok(page.iter().rev().map(summary).collect())
    }

    /// Counts the account's transfers into `audit`, oldest first, until all are counted
    /// (`complete`), [`AUDIT_PAGES_MAX`] pages are, or `deadline` passes. Why the deadline ends
    /// the count rather than the audit: a caller busy for hours has more transfers than one
    /// deadline reads, and its operator still needs its balances and latest transfers (the
    /// inspect of such a caller answered 503).
    async fn count_transfers(
        &self,
        audit: &mut AccountAudit,
        account_id: u128,
        deadline: Instant,
    ) -> Result<(), LedgerError> {
        let both = tb::account::FilterFlags::DEBITS | tb::account::FilterFlags::CREDITS;
        let mut timestamp_min = SystemTime::UNIX_EPOCH;
        for _ in 0..AUDIT_PAGES_MAX {
            let read = self.transfers_page(
                account_id,
                both,
                (timestamp_min, None),
                (Place::AtOnce, deadline),
            );
            let page = match read.await {
                Ok(page) => page,
                // Its deadline, or no place under the in-flight bound before it (an operator
                // waits for one, to its deadline): the count ends, incomplete; the balances and
                // recent transfers read stand.
                Err(LedgerError::Timeout { .. } | LedgerError::Overloaded { .. }) => return Ok(()),
                Err(error) => return Err(error),
            };
            page.iter().for_each(|transfer| audit.count(transfer));
            match page.last() {
                Some(last) if page.len() == TRANSFERS_PAGE_LIMIT as usize => {
                    timestamp_min = last.timestamp() + std::time::Duration::from_nanos(1);
                }
                _ => {
                    audit.complete = true;
                    return Ok(());
                }
            }
        }
        Ok(())
    }
}

impl AccountAudit {
    fn count(&mut self, transfer: &tb::Transfer) {
        self.transfers_read += 1;
        let flags = transfer.flags();
        let void = flags.contains(tb::transfer::Flags::VOID_PENDING_TRANSFER);
        match transfer.code() {
            model::TRANSFER_CODE_GRANT => self.grants += 1,
            model::TRANSFER_CODE_REDUCE => self.reductions += 1,
            model::TRANSFER_CODE_TOP_UP => self.top_ups += 1,
            model::TRANSFER_CODE_BLOCK if void => self.unblocks += 1,
            model::TRANSFER_CODE_BLOCK => self.blocks += 1,
            model::TRANSFER_CODE_MOVE if void => self.moves_back += 1,
            model::TRANSFER_CODE_MOVE => self.moves_out += 1,
            model::TRANSFER_CODE_CARRY => self.carried_in += 1,
            super::lease::TRANSFER_CODE_LEASE if void => {
                self.leases_settled += 1;
                self.lease_requests += transfer.user_data_64();
            }
            super::lease::TRANSFER_CODE_LEASE => self.leases += 1,
            super::lease::TRANSFER_CODE_LEASE_SETTLEMENT => self.lease_settlements += 1,
            _ if !void && is_over_charge(transfer) => self.over_charges += 1,
            _ => self.count_request(flags, void),
        }
    }

    fn count_request(&mut self, flags: tb::transfer::Flags, void: bool) {
        if void {
            self.voids += 1;
        } else if flags.contains(tb::transfer::Flags::PENDING) {
            self.holds += 1;
        }
    }
}

fn is_over_charge(transfer: &tb::Transfer) -> bool {
    transfer.code() == model::TRANSFER_CODE_REQUEST
        && transfer.user_data_32() == model::OVER_CHARGE_USER_DATA_32
}

fn summary(transfer: &tb::Transfer) -> TransferSummary {
    let void = transfer
        .flags()
        .contains(tb::transfer::Flags::VOID_PENDING_TRANSFER);
    let kind = match (transfer.code(), void) {
        (model::TRANSFER_CODE_GRANT, _) => "grant".to_owned(),
        (model::TRANSFER_CODE_REQUEST, false) if is_over_charge(transfer) => {
            "over_charge".to_owned()
        }
        (model::TRANSFER_CODE_REQUEST, false) => "hold".to_owned(),
        (model::TRANSFER_CODE_REQUEST, true) => "void".to_owned(),
        (model::TRANSFER_CODE_TOP_UP, _) => "top_up".to_owned(),
        (model::TRANSFER_CODE_REDUCE, _) => "reduction".to_owned(),
        (model::TRANSFER_CODE_BLOCK, false) => "block".to_owned(),
        (model::TRANSFER_CODE_BLOCK, true) => "unblock".to_owned(),
        (model::TRANSFER_CODE_MOVE, false) => "move".to_owned(),
        (model::TRANSFER_CODE_MOVE, true) => "move_back".to_owned(),
        (model::TRANSFER_CODE_CARRY, _) => "carried".to_owned(),
        (super::lease::TRANSFER_CODE_LEASE, false) => "lease".to_owned(),
        (super::lease::TRANSFER_CODE_LEASE, true) => "lease_settled".to_owned(),
        (super::lease::TRANSFER_CODE_LEASE_SETTLEMENT, _) => "settlement".to_owned(),
        (code, _) => format!("code_{code}"),
    };
    let timestamp_ns = transfer
        .timestamp()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    TransferSummary {
        id: format!("{:032x}", transfer.id()),
        kind,
        amount: transfer.amount(),
        timestamp_ns,
        timeout_seconds: transfer.timeout(),
    }
}
