//! The ledger model: which accounts and transfers represent a rate limit, and their ids.
//!
//! - One TigerBeetle ledger per limit dimension (today: request rate, [`LEDGER_REQUEST_RATE`]).
//! - One **operator** account per ledger, id [`OPERATOR_ACCOUNT_ID`]: the source of all credit.
//! - One **user** account per (caller key, plan) with `debits_must_not_exceed_credits`, credited
//!   once by the operator with the plan's capacity (the *grant*).
//! - Each request: a **pending** transfer user → operator of `cost`, `timeout` = the plan's window.
//!   While pending it holds credit; when it expires the credit returns. `exceeds_credits` = limited.
//!
//! Ids are derived deterministically so that provisioning is idempotent across instances:
//! user account ids and grant ids have the top bit set (never 0, never an operator id, and
//! `u128::MAX` is mapped away), request transfer ids are TigerBeetle time-based ids.

use std::num::{NonZeroU32, NonZeroU64};

use sha2::{Digest, Sha256};
use tigerbeetle_unofficial as tb;

/// The ledger that counts request credit. Later limits (per day, per token...) get their own.
pub const LEDGER_REQUEST_RATE: u32 = 1;
/// The ledger that counts requests in flight (concurrency limits): a slot is a hold, voided when
/// the response is ready, and released by its timeout if an instance dies first.
pub const LEDGER_CONCURRENCY: u32 = 2;
/// The operator account of the request-rate ledger. Documented; operator ids have the top bit clear.
pub const OPERATOR_ACCOUNT_ID: u128 = 1;

/// The operator account of a ledger: the ledger's number (so `OPERATOR_ACCOUNT_ID` on ledger 1).
/// An account lives on one ledger, so each ledger has its own.
pub fn operator_account_id(ledger: u32) -> u128 {
    u128::from(ledger)
}

/// The **operator epoch** account of a ledger: credited 1 by every operator action (top-up,
/// reduction, block, unblock, move), so that each instance, reading it once a second, knows when
/// what it remembers of callers' credit may be stale. Top bit clear (not a user id), above every
/// operator id.
pub fn operator_epoch_account_id(ledger: u32) -> u128 {
    (1u128 << 64) | u128::from(ledger)
}

/// Account codes (TigerBeetle `code`: the account's type).
pub const ACCOUNT_CODE_OPERATOR: u16 = 1;
pub const ACCOUNT_CODE_USER: u16 = 2;
pub const ACCOUNT_CODE_OPERATOR_EPOCH: u16 = 3;

/// Transfer codes (TigerBeetle `code`: why money moved).
pub const TRANSFER_CODE_GRANT: u16 = 1;
pub const TRANSFER_CODE_REQUEST: u16 = 2;
/// An operator's top-up of a caller's credit (admin API); `user_data_64` = which admin secret,
/// `user_data_128` = SHA-256 of the reason, truncated (the same for codes 4 and 5).
pub const TRANSFER_CODE_TOP_UP: u16 = 3;
/// An operator's reduction of a caller's credit (admin API).
pub const TRANSFER_CODE_REDUCE: u16 = 4;
/// An operator's block: a pending, zero-amount `closing_debit` transfer. While it is pending the
/// caller's account is closed (every hold fails `debit_account_already_closed`); voiding it or
/// its timeout reopens the account.
pub const TRANSFER_CODE_BLOCK: u16 = 5;
/// An operator's move of a caller to another plan: a pending, zero-amount `closing_debit` with
/// no timeout on the account of the plan it leaves; `user_data_64` = the new plan's
/// [`plan_tag`], `user_data_32` = which admin secret. Requests that find the account closed by
/// it follow it to the new plan's account.
pub const TRANSFER_CODE_MOVE: u16 = 6;
/// A hold carried to the new plan's account when a caller moves, for the rest of its timeout
/// (`user_data_128` = the account it came from), so a move gives no fresh credit.
pub const TRANSFER_CODE_CARRY: u16 = 7;

/// One operator action happened (see [`operator_epoch_account_id`]).
pub const TRANSFER_CODE_OPERATOR_EPOCH: u16 = 8;

pub fn operator_epoch_account(ledger: u32) -> tb::Account {
    tb::Account::new(
        operator_epoch_account_id(ledger),
        ledger,
        ACCOUNT_CODE_OPERATOR_EPOCH,
    )
}

pub fn operator_epoch_transfer(ledger: u32) -> tb::Transfer {
    tb::Transfer::new(tb::id())
        .with_debit_account_id(operator_account_id(ledger))
        .with_credit_account_id(operator_epoch_account_id(ledger))
        .with_amount(1u32.into())
        .with_ledger(ledger)
        .with_code(TRANSFER_CODE_OPERATOR_EPOCH)
}

/// A plan's name as the ledger records it in a move (64 bits of its SHA-256).
pub fn plan_tag(plan_name: &str) -> u64 {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(plan_name.as_bytes());
    let mut tag = [0u8; 8];
    tag.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(tag)
}

/// Closes `account_id` for good, recording where its caller went (see [`TRANSFER_CODE_MOVE`]).
pub fn move_transfer(account_id: u128, ledger: u32, plan_tag: u64, actor: Actor) -> tb::Transfer {
    let who = u32::try_from(actor.who).unwrap_or(u32::MAX);
    tb::Transfer::new(tb::id())
        .with_debit_account_id(account_id)
        .with_credit_account_id(operator_account_id(ledger))
        .with_ledger(ledger)
        .with_code(TRANSFER_CODE_MOVE)
        .with_flags(tb::transfer::Flags::PENDING | tb::transfer::Flags::CLOSING_DEBIT)
        .with_user_data_64(plan_tag)
        .with_user_data_32(who)
        .with_user_data_128(actor.why)
}

/// Reopens an account a move closed (the caller moves back to its plan), recording who moved it
/// back and why, as the move does (`user_data_32`, `user_data_128`): TigerBeetle gives a void's
/// zero fields the pending transfer's values, so left out, they named the first move's operator.
pub fn unmove_transfer(move_id: u128, ledger: u32, actor: Actor) -> tb::Transfer {
    let who = u32::try_from(actor.who).unwrap_or(u32::MAX);
    void_transfer(move_id, ledger)
        .with_code(TRANSFER_CODE_MOVE)
        .with_user_data_32(who)
        .with_user_data_128(actor.why)
}

/// A carried hold: as much of `amount` as the new account has free (balancing), pending for
/// `timeout_seconds`.
pub fn carry_transfer(
    to_account_id: u128,
    from_account_id: u128,
    ledger: u32,
    amount: u64,
    timeout_seconds: u32,
) -> tb::Transfer {
    balancing_hold_transfer(to_account_id, ledger, amount, timeout_seconds)
        .with_code(TRANSFER_CODE_CARRY)
        .with_user_data_128(from_account_id)
}

/// Who changed a caller's credit (the admin secret's number) and why (a hash of the reason).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Actor {
    pub who: u64,
    pub why: u128,
}

/// The longest reason an operator may give (its hash goes to the ledger).
pub const REASON_LENGTH_MAX: usize = 200;

impl Actor {
    /// `who` acting for `reason` (1 to [`REASON_LENGTH_MAX`] bytes, no control characters;
    /// `None` otherwise): the reason's SHA-256, truncated, is what the ledger records. Why no
    /// control characters: the reason is logged as written, the service's record of why, and a
    /// newline in it wrote a line of its own there (an action another secret never did).
    pub fn from_reason(who: u64, reason: &str) -> Option<Actor> {
        use sha2::{Digest, Sha256};
        let bounded = !reason.is_empty() && reason.len() <= REASON_LENGTH_MAX;
        // Line and paragraph separators break lines in many log viewers; bidirectional
        // overrides reorder a line as shown.
        let misleading = |c: char| {
            c.is_control()
                || matches!(c, '\u{2028}' | '\u{2029}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
        };
        if !bounded || reason.chars().any(misleading) {
            return None;
        }
        let mut why = [0u8; 16];
        why.copy_from_slice(&Sha256::digest(reason.as_bytes())[..16]);
        Some(Actor {
            who,
            why: u128::from_le_bytes(why),
        })
    }
}

/// The most bytes an [`IdempotencyKey`] may have.
pub const IDEMPOTENCY_KEY_LENGTH_MAX: usize = 255;

/// An operator's own name for one credit adjustment (the admin API's `Idempotency-Key` header,
/// `--idempotency-key` on the command line): 1 to [`IDEMPOTENCY_KEY_LENGTH_MAX`] bytes of
/// visible ASCII. The adjustment's transfer id derives from it and the account, so a retry of an
/// adjustment whose answer was lost (a 503 after the deadline, while the transfer went through)
/// is the same transfer, which the ledger answers `exists`, never a second one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyKey(Vec<u8>);

impl IdempotencyKey {
    pub fn new(bytes: &[u8]) -> Option<Self> {
        let valid = (1..=IDEMPOTENCY_KEY_LENGTH_MAX).contains(&bytes.len())
            && bytes.iter().all(u8::is_ascii_graphic);
        valid.then(|| IdempotencyKey(bytes.to_vec()))
    }
}

/// The transfer id of the adjustment of `account_id` named `key`: one per account and key,
/// whatever the adjustment (a key reused for a different one is refused by the ledger).
pub fn adjustment_id(account_id: u128, key: &IdempotencyKey) -> u128 {
    derive_id(
        "ledger-limiter/v1/adjustment",
        &[&account_id.to_le_bytes(), &key.0],
    )
}

/// Whether `id` can be a caller's account: every derived id has the top bit set, and the
/// operator's accounts (the grants' source, the operator epoch) have it clear, so that no admin
/// request or command can block, debit or credit them as if they were a caller.
pub fn is_caller_account_id(id: u128) -> bool {
    id & USER_ID_BIT != 0
}

/// An account id as operators write it: 32 hex digits, `0x` allowed.
pub fn parse_account_id(text: &str) -> Option<u128> {
    // One `0x` at most: `0x0x…` is no id (`trim_start_matches` took any number).
    let hex = text.strip_prefix("0x").unwrap_or(text);
    let valid = hex.len() == 32 && hex.bytes().all(|b| b.is_ascii_hexdigit());
    valid.then(|| u128::from_str_radix(hex, 16).ok()).flatten()
}

fn operator_transfer(
    debit: u128,
    credit: u128,
    ledger: u32,
    code: u16,
    actor: Actor,
) -> tb::Transfer {
    tb::Transfer::new(tb::id())
        .with_debit_account_id(debit)
        .with_credit_account_id(credit)
        .with_ledger(ledger)
        .with_code(code)
        .with_user_data_64(actor.who)
        .with_user_data_128(actor.why)
}

/// An operator's gift of credit to a caller, posted at once: a lasting raise of its limit per
/// window, until reduced again.
pub fn top_up_transfer(account_id: u128, ledger: u32, amount: u64, actor: Actor) -> tb::Transfer {
    let operator = operator_account_id(ledger);
    operator_transfer(operator, account_id, ledger, TRANSFER_CODE_TOP_UP, actor)
        .with_amount(amount.into())
}

/// Closes the caller's account for `timeout_seconds` (see [`TRANSFER_CODE_BLOCK`]).
pub fn block_transfer(
    account_id: u128,
    ledger: u32,
    timeout_seconds: u32,
    actor: Actor,
) -> tb::Transfer {
    assert!(timeout_seconds > 0);
    let operator = operator_account_id(ledger);
    operator_transfer(account_id, operator, ledger, TRANSFER_CODE_BLOCK, actor)
        .with_flags(tb::transfer::Flags::PENDING | tb::transfer::Flags::CLOSING_DEBIT)
        .with_timeout(timeout_seconds)
}

/// The reason an unblock records when it is given none.
pub const UNBLOCK_REASON_DEFAULT: &str = "unblock";

/// Ends a block early (voids its closing transfer), for `actor`. TigerBeetle gives a void's zero
/// `user_data` fields its pending transfer's: a zero `who` (the command line) reads as the
/// block's, and `why` is never zero (a reason's hash).
pub fn unblock_transfer(block_id: u128, ledger: u32, actor: Actor) -> tb::Transfer {
    void_transfer(block_id, ledger)
        .with_code(TRANSFER_CODE_BLOCK)
        .with_user_data_64(actor.who)
        .with_user_data_128(actor.why)
}

/// An operator's reduction of a caller's credit, posted at once (it does not come back).
pub fn reduction_transfer(
    account_id: u128,
    ledger: u32,
    amount: u64,
    actor: Actor,
) -> tb::Transfer {
    let operator = operator_account_id(ledger);
    operator_transfer(account_id, operator, ledger, TRANSFER_CODE_REDUCE, actor)
        .with_amount(amount.into())
}

const USER_ID_BIT: u128 = 1 << 127;

fn derive_id(domain: &str, parts: &[&[u8]]) -> u128 {
    let mut hasher = Sha256::new();
    hasher.update(domain.as_bytes());
    for part in parts {
        // Length-prefix each part so ("ab","c") and ("a","bc") differ.
        hasher.update((part.len() as u64).to_le_bytes());
        hasher.update(part);
    }
    let digest = hasher.finalize();
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    let mut id = u128::from_le_bytes(bytes) | USER_ID_BIT;
    if id == u128::MAX {
        id -= 1;
    }
    assert!(id != 0 && id != u128::MAX && id & USER_ID_BIT != 0);
    id
}

/// What the ledger needs to open and credit one user account.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UserAccount {
    pub id: u128,
    /// The grant: credit when nothing is held.
    pub capacity: NonZeroU64,
    /// How long each hold lasts; recorded on the account for auditing.
    pub window_seconds: NonZeroU32,
}

/// The user account for a caller on a plan. The plan's name and capacity are part of the identity,
/// so a caller moved to another plan starts on a fresh account with that plan's grant. `key` is
/// the caller's secret: it goes into the hash and nowhere else.
pub fn user_account_id(ledger: u32, plan_name: &str, capacity: NonZeroU64, key: &[u8]) -> u128 {
    derive_id(
        "ledger-limiter/v1/account",
        &[
            &ledger.to_le_bytes(),
            plan_name.as_bytes(),
            &capacity.get().to_le_bytes(),
            key,
        ],
    )
}

/// The id of the one grant transfer that credits a user account: identical from every instance,
/// so racing provisioners create it once and the others get `exists`.
pub fn grant_transfer_id(user_account_id: u128) -> u128 {
    grant_transfer_id_at(user_account_id, 0)
}

/// Grant ids a user account may go through ([`grant_transfer_id_at`]).
pub const GRANT_IDS_MAX: u8 = 8;

/// The grant's id at `attempt` of a fixed sequence: the next is tried only once the one before
/// failed for good (`id_already_failed`: a transient refusal, its account closed between its
/// creation and its grant), and a failed id never succeeds, so at most one grant lands. The
/// first is [`grant_transfer_id`]'s, as ever.
pub fn grant_transfer_id_at(user_account_id: u128, attempt: u8) -> u128 {
    assert!(attempt < GRANT_IDS_MAX);
    let account = user_account_id.to_le_bytes();
    if attempt == 0 {
        return derive_id("ledger-limiter/v1/grant", &[&account]);
    }
    derive_id("ledger-limiter/v1/grant", &[&account, &[attempt]])
}

pub fn operator_account(ledger: u32) -> tb::Account {
    tb::Account::new(operator_account_id(ledger), ledger, ACCOUNT_CODE_OPERATOR)
}

pub fn user_account(account: &UserAccount, ledger: u32) -> tb::Account {
    tb::Account::new(account.id, ledger, ACCOUNT_CODE_USER)
        .with_flags(tb::account::Flags::DEBITS_MUST_NOT_EXCEED_CREDITS)
        .with_user_data_64(account.capacity.get())
        .with_user_data_32(account.window_seconds.get())
}

pub fn grant_transfer(account: &UserAccount, ledger: u32, attempt: u8) -> tb::Transfer {
    tb::Transfer::new(grant_transfer_id_at(account.id, attempt))
        .with_debit_account_id(operator_account_id(ledger))
        .with_credit_account_id(account.id)
        .with_amount(account.capacity.get().into())
        .with_ledger(ledger)
        .with_code(TRANSFER_CODE_GRANT)
}

/// Gives a hold's credit back at once (a refund, or a hold whose request was refused).
pub fn void_transfer(pending_id: u128, ledger: u32) -> tb::Transfer {
    tb::Transfer::new(tb::id())
        .with_pending_id(pending_id)
        .with_ledger(ledger)
        .with_code(TRANSFER_CODE_REQUEST)
        .with_flags(tb::transfer::Flags::VOID_PENDING_TRANSFER)
}

/// `user_data_32` of the Envoy front end's over-charge (a code-2 balancing hold of what remained
/// of a charge that did not fit, `user_data_64` = the charge): how the audit tells it from a
/// request's hold, and from a recharge's (balancing too, linked with the void it replaces).
pub const OVER_CHARGE_USER_DATA_32: u32 = 1;

/// The Envoy front end's over-charge: what remains on the account of a refused `charge`, held,
/// up to `amount_max` (`charge − 1` on the descriptor that refused, never the whole:
/// [`super::Ledger::hold_what_remains`]; `charge` on the call's others:
/// [`super::Ledger::hold_up_to`]).
pub fn over_charge_transfer(
    user_account_id: u128,
    ledger: u32,
    (charge, amount_max): (u64, u64),
    timeout_seconds: u32,
) -> tb::Transfer {
    assert!(amount_max <= charge);
    balancing_hold_transfer(user_account_id, ledger, amount_max, timeout_seconds)
        .with_user_data_64(charge)
        .with_user_data_32(OVER_CHARGE_USER_DATA_32)
}

/// A hold of as much of `amount` as the account has free (a balancing debit: all of what is
/// left when less, 0 when nothing is), pending for `timeout_seconds`.
pub fn balancing_hold_transfer(
    user_account_id: u128,
    ledger: u32,
    amount: u64,
    timeout_seconds: u32,
) -> tb::Transfer {
    let hold = hold_transfer(user_account_id, ledger, amount, timeout_seconds);
    let flags = hold.flags() | tb::transfer::Flags::BALANCING_DEBIT;
    hold.with_flags(flags)
}

/// A request's hold: pending, so it expires and gives the credit back after `timeout_seconds`.
pub fn hold_transfer(
    user_account_id: u128,
    ledger: u32,
    amount: u64,
    timeout_seconds: u32,
) -> tb::Transfer {
    assert!(amount > 0 && timeout_seconds > 0);
    tb::Transfer::new(tb::id())
        .with_debit_account_id(user_account_id)
        .with_credit_account_id(operator_account_id(ledger))
        .with_amount(amount.into())
        .with_ledger(ledger)
        .with_code(TRANSFER_CODE_REQUEST)
        .with_flags(tb::transfer::Flags::PENDING)
        .with_timeout(timeout_seconds)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn id(ledger: u32, plan: &str, capacity: u64, key: &str) -> u128 {
        user_account_id(
            ledger,
            plan,
            NonZeroU64::new(capacity).unwrap(),
            key.as_bytes(),
        )
    }

    /// A reason is logged as written: one with a line break (or any control character) could
    /// forge a line of the log that records operators' actions.
    #[test]
    fn a_reason_is_bounded_and_has_no_control_characters() {
        assert!(Actor::from_reason(1, "abuse report 7 — ticket 12").is_some());
        let too_long = "x".repeat(REASON_LENGTH_MAX + 1);
        for refused in [
            "",
            too_long.as_str(),
            "ok\nINFO caller blocked secret=2",
            "a\rb",
            "\u{1b}[31m",
            "a\tb",
            "a\u{2028}b",
            "\u{202e}dekcolb",
        ] {
            assert!(Actor::from_reason(1, refused).is_none(), "{refused:?}");
        }
    }

    #[test]
    fn ids_are_deterministic_and_distinct() {
        let a = id(LEDGER_REQUEST_RATE, "free", 5, "a");
        assert_eq!(a, id(LEDGER_REQUEST_RATE, "free", 5, "a"));
        assert_ne!(a, id(LEDGER_REQUEST_RATE, "free", 5, "b"));
        assert_ne!(a, id(LEDGER_REQUEST_RATE, "pro", 5, "a"));
        assert_ne!(a, id(LEDGER_REQUEST_RATE, "free", 6, "a"));
        assert_ne!(a, id(2, "free", 5, "a"));
        // The length prefix keeps the parts apart.
        assert_ne!(id(1, "fre", 5, "ea"), id(1, "free", 5, "a"));
        assert_ne!(grant_transfer_id(a), a);
        assert_eq!(grant_transfer_id(a), grant_transfer_id(a));
        let grants: std::collections::HashSet<u128> = (0..GRANT_IDS_MAX)
            .map(|n| grant_transfer_id_at(a, n))
            .collect();
        assert_eq!(grants.len(), usize::from(GRANT_IDS_MAX));
    }

    proptest! {
        #[test]
        fn user_ids_never_collide_with_reserved_ids(k in "[!-~]{1,64}", ledger in any::<u32>()) {
            let id = id(ledger, "free", 5, &k);
            prop_assert!(id != 0 && id != u128::MAX && id != OPERATOR_ACCOUNT_ID);
            prop_assert!(id != operator_epoch_account_id(ledger));
            prop_assert!(id & USER_ID_BIT != 0);
            prop_assert!(is_caller_account_id(id));
            let grant = grant_transfer_id(id);
            prop_assert!(grant != 0 && grant != u128::MAX);
        }
    }
}
