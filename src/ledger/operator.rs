//! An operator's actions on one caller's account: top up or reduce its credit, block it for a
//! while and unblock it. Each is one transfer from or to the operator account, carrying who acted
//! and why ([`Actor`]), so the audit trail shows every change.

use std::time::{Duration, Instant, SystemTime};

use tb::error::CreateTransferErrorKind;
use tigerbeetle_unofficial as tb;

use super::model::{self, Actor, IdempotencyKey};
use super::{unexpected_transfer, Ledger, LedgerError};
use super::{TRANSFERS_PAGES_MAX, TRANSFERS_PAGE_LIMIT};

/// How often [`Ledger::block`] sends a block again while the last one has ended and TigerBeetle
/// has not yet expired it.
pub const BLOCK_RETRY_INTERVAL: Duration = Duration::from_millis(20);

/// How long after a block's end it may still close the account, before TigerBeetle expires it
/// (observed 5 to 100 ms): only that long is a new block sent again.
pub const BLOCK_EXPIRY_LAG_MAX: Duration = Duration::from_secs(1);

/// What an operator's credit change came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Adjusted {
    Done,
    /// This very adjustment (same idempotency key, same fields) went through before: a retry,
    /// which changed nothing now.
    AlreadyDone,
    /// A reduction larger than the credit not held.
    NotEnoughCredit,
    NoSuchAccount,
    /// The account is closed by a block: unblock it first.
    Blocked,
    /// The account is closed for good by a move of its caller to another plan: the caller's
    /// account is the new plan's.
    Moved,
    /// The idempotency key named an adjustment that differs from this one (amount, direction
    /// or why): nothing was changed. (Who sent it is not what it is: the same adjustment sent
    /// with another secret is [`Adjusted::AlreadyDone`].)
    KeyReused,
    /// The idempotency key's adjustment was refused before (not enough credit, no account, a
    /// block), and a refused transfer's id answers `id_already_failed` for good: nothing was
    /// changed, and only a new key can apply it.
    KeyFailed,
}

/// What a block came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blocking {
    /// Blocked until the transfer's timeout, or until it is voided.
    Done {
        transfer_id: u128,
    },
    AlreadyBlocked,
    /// Closed for good by a move of its caller to another plan (see [`Adjusted::Moved`]).
    Moved,
    NoSuchAccount,
}

/// What an unblock came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unblocking {
    Done,
    /// The account is open (never blocked, or the block expired).
    NotBlocked,
    /// Closed for good by a move of its caller to another plan (see [`Adjusted::Moved`]).
    Moved,
    NoSuchAccount,
}

fn adjusted(kind: Option<CreateTransferErrorKind>, what: &str) -> Result<Adjusted, LedgerError> {
    use CreateTransferErrorKind as K;
    match kind {
        None => Ok(Adjusted::Done),
        Some(K::Exists) => Ok(Adjusted::AlreadyDone),
        Some(
            K::ExistsWithDifferentAmount
            | K::ExistsWithDifferentCode
            | K::ExistsWithDifferentCreditAccountId
            | K::ExistsWithDifferentDebitAccountId
            | K::ExistsWithDifferentFlags
            | K::ExistsWithDifferentUserData128,
        ) => Ok(Adjusted::KeyReused),
        // Only who sent it differs (the secret's number, `user_data_64`): the same adjustment,
        // sent again with another secret, as after a rotation renumbered them (a 422 then had an
        // operator's retry of a lost answer refused). The ledger compares the fields in order
        // (`create_transfer_exists`, 0.16): flags, accounts, amount and why before it; after
        // it, `user_data_32`, the ledger and the code, which one key's adjustments share (a
        // top-up and a reduction differ in their accounts).
        Some(K::ExistsWithDifferentUserData64) => Ok(Adjusted::AlreadyDone),
        Some(K::ExceedsCredits) => Ok(Adjusted::NotEnoughCredit),
        // Not found, or not a caller of this ledger (a concurrency slot's account, ledger 2).
        Some(
            K::DebitAccountNotFound | K::CreditAccountNotFound | K::AccountsMustHaveTheSameLedger,
        ) => Ok(Adjusted::NoSuchAccount),
        Some(K::DebitAccountAlreadyClosed | K::CreditAccountAlreadyClosed) => Ok(Adjusted::Blocked),
        Some(K::IdAlreadyFailed) => Ok(Adjusted::KeyFailed),
        Some(kind) => Err(unexpected_transfer(what, kind)),
    }
}

/// `transfer` with the id its idempotency key gives it, if any.
fn once_only(
    transfer: tb::Transfer,
    account_id: u128,
    once: Option<&IdempotencyKey>,
) -> tb::Transfer {
    match once {
        Some(key) => transfer.with_id(model::adjustment_id(account_id, key)),
        None => transfer,
    }
}

impl Ledger {
    /// Counts one operator action in the ledger's operator epoch (best effort: an instance that
    /// misses it still refuses only what the ledger would, for at most the callers' windows).
    pub(super) async fn bump_operator_epoch(&self, deadline: Instant) {
        // The action it counts is done: this must still go.
        let deadline = super::follow_up_deadline(deadline);
        let accounts = vec![
            model::operator_account(self.ledger_id),
            model::operator_epoch_account(self.ledger_id),
        ];
        let bumped = async {
            let placed = (super::Place::Waited, deadline);
            self.create_accounts_idempotent(accounts, placed).await?;
            let bump = model::operator_epoch_transfer(self.ledger_id);
            match self.operator_transfer(bump, deadline).await? {
                None => Ok(()),
                Some(kind) => Err(unexpected_transfer("operator epoch: ", kind)),
            }
        };
        if let Err(error) = bumped.await {
            tracing::warn!(%error, "could not count an operator action; other instances see it when their callers' holds expire");
        }
    }

    /// How many operator actions this ledger has seen (0 before the first). Read as an
    /// operator's action (it waits for a place under the in-flight bound by `deadline`): each
    /// instance's follower reads it to learn of every act, and a flood that fills the bound is
    /// when an operator acts; refused at once, a block reached no instance until it ended.
    pub async fn operator_epoch(&self, deadline: Instant) -> Result<u128, LedgerError> {
        let id = model::operator_epoch_account_id(self.ledger_id);
        let account = super::as_operator_action(self.lookup_account(id, deadline)).await?;
        Ok(account.map_or(0, |a| a.credits_posted()))
    }

    async fn operator_transfer(
        &self,
        transfer: tb::Transfer,
        deadline: Instant,
    ) -> Result<Option<CreateTransferErrorKind>, LedgerError> {
        let answer = |kind, _| Ok(kind);
        // Waited for, not refused at once: a flood that fills the bound is when an operator
        // blocks, and an action's deadline (seconds) bounds the wait.
        let placed = (super::Place::Waited, deadline);
        self.single_transfer_placed(transfer, placed, None, answer)
            .await
    }

    /// [`Ledger::operator_transfer`] for a caller's credit or block, announced to every instance
    /// when its answer is lost too: it may have landed after all, and instances that heard
    /// nothing kept their local views (a top-up refused from memory for up to a window). A retry
    /// with the same idempotency key would announce it, but none may come. A move does the same.
    async fn operator_action(
        &self,
        transfer: tb::Transfer,
        deadline: Instant,
    ) -> Result<Option<CreateTransferErrorKind>, LedgerError> {
        let created = self.operator_transfer(transfer, deadline).await;
        if created.is_err() {
            self.bump_operator_epoch(deadline).await;
        }
        created
    }

    /// An adjustment's answer, told to every instance when done, and a closed account's
    /// reason read (a block, or a move that closed it for good).
    async fn bumped_if(
        &self,
        account_id: u128,
        adjusted: Result<Adjusted, LedgerError>,
        deadline: Instant,
    ) -> Result<Adjusted, LedgerError> {
        match adjusted? {
            // A retry bumps again: the first may have been done but its bump missed.
            done @ (Adjusted::Done | Adjusted::AlreadyDone) => {
                self.bump_operator_epoch(deadline).await;
                Ok(done)
            }
            // Known not applied: a follow-up's deadline of its own (the action's may be spent
            // by a late refusal), and a read that fails leaves it blocked, not "unknown": a
            // 503 had the operator retry a key the ledger then said was refused before.
            Adjusted::Blocked => {
                let read = self.closed_by_move(account_id, super::follow_up_deadline(deadline));
                match read.await {
                    Ok(true) => Ok(Adjusted::Moved),
                    Ok(false) | Err(_) => Ok(Adjusted::Blocked),
                }
            }
            other => Ok(other),
        }
    }

    /// Whether a closed account was closed by a move (else by a block).
    pub(super) async fn closed_by_move(
        &self,
        account_id: u128,
        deadline: Instant,
    ) -> Result<bool, LedgerError> {
        Ok(self
            .closed_by(account_id, deadline)
            .await?
            .moved_to
            .is_some())
    }

    /// Takes `amount` of credit from a caller for good (a posted transfer to the operator). Only
    /// credit not held can be taken. With `once`, a retry of the same reduction is a no-op.
    pub async fn reduce_credit(
        &self,
        account_id: u128,
        amount: u64,
        (actor, once): (Actor, Option<&IdempotencyKey>),
        deadline: Instant,
    ) -> Result<Adjusted, LedgerError> {
        let transfer = model::reduction_transfer(account_id, self.ledger_id, amount, actor);
        let transfer = once_only(transfer, account_id, once);
        let kind = self.operator_action(transfer, deadline).await?;
        self.bumped_if(account_id, adjusted(kind, "reduction: "), deadline)
            .await
    }

    /// Gives a caller `amount` more credit for good: its limit per window grows by that much.
    /// With `once`, a retry of the same top-up is a no-op.
    pub async fn top_up(
        &self,
        account_id: u128,
        amount: u64,
        (actor, once): (Actor, Option<&IdempotencyKey>),
        deadline: Instant,
    ) -> Result<Adjusted, LedgerError> {
        let transfer = model::top_up_transfer(account_id, self.ledger_id, amount, actor);
        let transfer = once_only(transfer, account_id, once);
        let created = self.operator_transfer(transfer, deadline).await;
        // Its answer lost: it may have landed all the same.
        let lost = created.is_err();
        let adjusted = created.and_then(|kind| adjusted(kind, "top-up: "));
        // Landed, or maybe (without a retry, nothing finished the grant then, and the caller
        // kept the top-up in place of its capacity and the top-up). Before the announcement:
        // instances then read the account granted.
        if lost || matches!(adjusted, Ok(Adjusted::Done | Adjusted::AlreadyDone)) {
            let follow_up = super::follow_up_deadline(deadline);
            if let Err(error) = self.finish_grant(account_id, follow_up).await {
                tracing::warn!(%error, "topped up, but whether the caller's grant landed is unknown");
            }
        }
        if lost {
            // As [`Ledger::operator_action`]'s: announced all the same.
            self.bump_operator_epoch(deadline).await;
        }
        self.bumped_if(account_id, adjusted, deadline).await
    }

    /// Grants a caller's account its plan's capacity if that never landed (its first request's
    /// grant failed, and no request since finished it). Why: a top-up counts as credit posted,
    /// which is how a request tells a granted account, so the grant was never finished and the
    /// caller kept the top-up in place of its capacity and the top-up. Idempotent, as every
    /// provisioning is: a grant that landed answers `exists`. What to grant is on the account
    /// itself (`user_data_64` and `user_data_32`). After the top-up, not before: a read first
    /// spent the top-up's deadline on a stalled ledger, and the top-up was never sent.
    async fn finish_grant(&self, account_id: u128, deadline: Instant) -> Result<(), LedgerError> {
        let Some(account) = self.lookup_account(account_id, deadline).await? else {
            return Ok(());
        };
        let callers = account.code() == model::ACCOUNT_CODE_USER
            && account.ledger() == self.ledger_id
            && !account.flags().contains(tb::account::Flags::CLOSED);
        let capacity = std::num::NonZeroU64::new(account.user_data_64());
        let window_seconds = std::num::NonZeroU32::new(account.user_data_32());
        let (true, Some(capacity), Some(window_seconds)) = (callers, capacity, window_seconds)
        else {
            return Ok(());
        };
        let account = model::UserAccount {
            id: account_id,
            capacity,
            window_seconds,
        };
        self.provision(&account, deadline).await
    }

    /// Closes the caller's account for `seconds`: every request of it is refused meanwhile, on
    /// every instance, and its holds still expire as usual.
    ///
    /// A block sent as the last one ends, before TigerBeetle has expired it (observed 5 to 100
    /// ms after), finds the account still closed: it is sent again until the deadline, every
    /// [`BLOCK_RETRY_INTERVAL`], rather than answered "blocked already" just before the account
    /// reopens unblocked (a script renewing a block as it ends hit exactly that). Only within
    /// [`BLOCK_EXPIRY_LAG_MAX`] of the old block's end.
    pub async fn block(
        &self,
        account_id: u128,
        seconds: u32,
        actor: Actor,
        deadline: Instant,
    ) -> Result<Blocking, LedgerError> {
        loop {
            if let Some(blocking) = self
                .block_once(account_id, seconds, actor, deadline)
                .await?
            {
                return Ok(blocking);
            }
            if Instant::now() + BLOCK_RETRY_INTERVAL >= deadline {
                // The old block still closes the account: the new one is not made, and the
                // operator is told to try again (a 503), not that the caller is blocked.
                let operation = super::metrics::Operation::CreateTransfers;
                let error = LedgerError::Timeout { operation };
                self.metrics.record_error(error.kind());
                return Err(error);
            }
            tokio::time::sleep(BLOCK_RETRY_INTERVAL).await;
        }
    }

    /// One attempt of [`Ledger::block`]: `None` when the last block has ended but still closes
    /// the account.
    async fn block_once(
        &self,
        account_id: u128,
        seconds: u32,
        actor: Actor,
        deadline: Instant,
    ) -> Result<Option<Blocking>, LedgerError> {
        use CreateTransferErrorKind as K;
        let transfer = model::block_transfer(account_id, self.ledger_id, seconds, actor);
        let transfer_id = transfer.id();
        let blocking = match self.operator_action(transfer, deadline).await? {
            None => {
                // Every instance must hear of it within a second (their leases and local views).
                self.bump_operator_epoch(deadline).await;
                Blocking::Done { transfer_id }
            }
            Some(K::DebitAccountAlreadyClosed) => {
                // A deadline of its own: a late refusal spent the action's, and a read never
                // sent answered 503 for a block the ledger had refused.
                let follow_up = super::follow_up_deadline(deadline);
                let closed = self.closed_by(account_id, follow_up).await?;
                if closed.moved_to.is_some() {
                    return Ok(Some(Blocking::Moved));
                }
                // Ended (by this instance's clock), not yet expired: it reopens in a moment. A
                // block that ended over a second ago by this clock, or has not ended, is
                // another's: this clock may be off the cluster's.
                let now = SystemTime::now();
                let ending = |until: SystemTime| until <= now && now < until + BLOCK_EXPIRY_LAG_MAX;
                if closed.until.is_some_and(ending) {
                    return Ok(None);
                }
                // Perhaps a retry of a block whose bump was missed: count it again, so that
                // every instance hears of it (a bump is one transfer; blocks are rare).
                self.bump_operator_epoch(deadline).await;
                Blocking::AlreadyBlocked
            }
            // Not found, or not a caller of this ledger (a concurrency slot's account).
            Some(
                K::DebitAccountNotFound
                | K::CreditAccountNotFound
                | K::AccountsMustHaveTheSameLedger,
            ) => Blocking::NoSuchAccount,
            Some(kind) => return Err(unexpected_transfer("block: ", kind)),
        };
        Ok(Some(blocking))
    }

    /// Ends the caller's block now (voids the closing transfer), recording who and why.
    pub async fn unblock(
        &self,
        account_id: u128,
        actor: Actor,
        deadline: Instant,
    ) -> Result<Unblocking, LedgerError> {
        use CreateTransferErrorKind as K;
        let account = self.lookup_account(account_id, deadline).await?;
        // Only a caller's account of this ledger: another's (a concurrency limit's slots, on
        // ledger 2) was answered "not blocked", and told every instance to forget what it knew.
        let Some(account) = account.filter(|account| self.is_callers(account)) else {
            return Ok(Unblocking::NoSuchAccount);
        };
        if !account.flags().contains(tb::account::Flags::CLOSED) {
            // Perhaps a retry of an unblock that was done but not answered, or whose bump was
            // missed: without a bump, instances that read the block refuse from memory until
            // they ask the ledger again.
            self.bump_operator_epoch(deadline).await;
            return Ok(Unblocking::NotBlocked);
        }
        let block = self.latest_block(account_id, deadline).await?;
        let block = match block {
            Some(block) if block.code() == model::TRANSFER_CODE_BLOCK => block,
            // Closed by a move: that account is not the caller's any more.
            Some(_) => return Ok(Unblocking::Moved),
            None => return Ok(Unblocking::NotBlocked),
        };
        let void = model::unblock_transfer(block.id(), self.ledger_id, actor);
        match self.operator_action(void, deadline).await? {
            None => {
                self.bump_operator_epoch(deadline).await;
                Ok(Unblocking::Done)
            }
            // It expired (or another operator unblocked) meanwhile: open either way.
            Some(K::PendingTransferExpired | K::PendingTransferAlreadyVoided) => {
                self.bump_operator_epoch(deadline).await;
                Ok(Unblocking::NotBlocked)
            }
            Some(kind) => Err(unexpected_transfer("unblock: ", kind)),
        }
    }

    /// What closed an account: a block (and when it ends, for Retry-After) or a move.
    pub(super) async fn closed_by(
        &self,
        account_id: u128,
        deadline: Instant,
    ) -> Result<super::Blocked, LedgerError> {
        let closing = self.latest_block(account_id, deadline).await?;
        Ok(match closing {
            Some(t) if t.code() == model::TRANSFER_CODE_MOVE => super::Blocked {
                until: None,
                moved_to: Some(t.user_data_64()),
            },
            Some(t) => super::Blocked {
                until: Some(t.timestamp() + Duration::from_secs(u64::from(t.timeout()))),
                moved_to: None,
            },
            None => super::Blocked {
                until: None,
                moved_to: None,
            },
        })
    }

    /// The closing transfer that keeps the account closed: the latest block or move among its
    /// debits. Each is read among the debits of its own code: a closed account still takes voids
    /// (refunds, lease settlements, an Envoy caller's released units), thousands of them after
    /// its closing transfer, and a read of every debit lost the block past 16 pages (an unblock
    /// answered "not blocked", and a moved caller was refused as blocked instead of followed).
    pub(super) async fn latest_block(
        &self,
        account_id: u128,
        deadline: Instant,
    ) -> Result<Option<tb::Transfer>, LedgerError> {
        let (block, moved) = tokio::join!(
            self.latest_closing(account_id, model::TRANSFER_CODE_BLOCK, deadline),
            self.latest_closing(account_id, model::TRANSFER_CODE_MOVE, deadline),
        );
        Ok(match (block?, moved?) {
            (Some(block), Some(moved)) => {
                Some(std::cmp::max_by_key(block, moved, |t| t.timestamp()))
            }
            (block, moved) => block.or(moved),
        })
    }

    /// The latest closing transfer of `code` among the account's debits (its voids are debits
    /// of the same code, one per closing at most).
    async fn latest_closing(
        &self,
        account_id: u128,
        code: u16,
        deadline: Instant,
    ) -> Result<Option<tb::Transfer>, LedgerError> {
        // The first page unbounded: this host's clock against the cluster's (a host 60 s
        // behind hid the latest block or move), then each page before the last one's.
        let mut timestamp_max = None;
        for _ in 0..TRANSFERS_PAGES_MAX {
            let page = self
                .latest_debits(account_id, (code, timestamp_max), deadline)
                .await?;
            let closing = tb::transfer::Flags::PENDING | tb::transfer::Flags::CLOSING_DEBIT;
            if let Some(block) = page.iter().find(|t| t.flags().contains(closing)) {
                return Ok(Some(*block));
            }
            match page.last() {
                Some(last) if page.len() == TRANSFERS_PAGE_LIMIT as usize => {
                    timestamp_max = Some(last.timestamp() - Duration::from_nanos(1));
                }
                _ => return Ok(None),
            }
        }
        Ok(None)
    }

    /// Up to a page of the account's debits of `code` created at or before `timestamp_max`
    /// (`None`: any), latest first.
    async fn latest_debits(
        &self,
        account_id: u128,
        (code, timestamp_max): (u16, Option<SystemTime>),
        deadline: Instant,
    ) -> Result<Vec<tb::Transfer>, LedgerError> {
        let flags = tb::account::FilterFlags::DEBITS | tb::account::FilterFlags::REVERSED;
        let mut filter =
            tb::account::Filter::new(account_id, TRANSFERS_PAGE_LIMIT).with_flags(flags);
        if let Some(timestamp_max) = timestamp_max {
            filter = filter.with_timestamp_max(timestamp_max);
        }
        // The crate's filter has no setter for it; TigerBeetle reads it (0: any code).
        filter.as_raw_mut().code = code;
        self.account_transfers(filter, (super::Place::AtOnce, deadline))
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_the_request_caused_is_an_answer_and_the_rest_an_error() {
        use CreateTransferErrorKind as K;
        let answer = |kind| adjusted(Some(kind), "test: ");
        assert_eq!(answer(K::IdAlreadyFailed), Ok(Adjusted::KeyFailed));
        assert_eq!(answer(K::Exists), Ok(Adjusted::AlreadyDone));
        assert_eq!(
            answer(K::AccountsMustHaveTheSameLedger),
            Ok(Adjusted::NoSuchAccount)
        );
        assert_eq!(answer(K::ExceedsCredits), Ok(Adjusted::NotEnoughCredit));
        assert!(answer(K::OverflowsCredits).is_err());
    }
}
