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

use sha2::{Digest, Sha256};
use tigerbeetle_unofficial as tb;

use crate::caller::CallerKey;
use crate::plan::Plan;

/// The ledger that counts request credit. Later limits (per day, per token...) get their own.
pub const LEDGER_REQUEST_RATE: u32 = 1;
/// The operator account of the request-rate ledger. Documented; operator ids have the top bit clear.
pub const OPERATOR_ACCOUNT_ID: u128 = 1;

/// Account codes (TigerBeetle `code`: the account's type).
pub const ACCOUNT_CODE_OPERATOR: u16 = 1;
pub const ACCOUNT_CODE_USER: u16 = 2;

/// Transfer codes (TigerBeetle `code`: why money moved).
pub const TRANSFER_CODE_GRANT: u16 = 1;
pub const TRANSFER_CODE_REQUEST: u16 = 2;

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

/// The user account for a caller on a plan. The plan's name and capacity are part of the identity,
/// so a caller moved to another plan starts on a fresh account with that plan's grant.
pub fn user_account_id(ledger: u32, plan: &Plan, key: &CallerKey) -> u128 {
    derive_id(
        "ledger-limiter/v1/account",
        &[
            &ledger.to_le_bytes(),
            plan.name().as_bytes(),
            &plan.capacity().get().to_le_bytes(),
            key.expose_secret().as_bytes(),
        ],
    )
}

/// The id of the one grant transfer that credits a user account: identical from every instance,
/// so racing provisioners create it once and the others get `exists`.
pub fn grant_transfer_id(user_account_id: u128) -> u128 {
    derive_id("ledger-limiter/v1/grant", &[&user_account_id.to_le_bytes()])
}

pub fn operator_account(ledger: u32) -> tb::Account {
    tb::Account::new(OPERATOR_ACCOUNT_ID, ledger, ACCOUNT_CODE_OPERATOR)
}

pub fn user_account(id: u128, ledger: u32, plan: &Plan) -> tb::Account {
    tb::Account::new(id, ledger, ACCOUNT_CODE_USER)
        .with_flags(tb::account::Flags::DEBITS_MUST_NOT_EXCEED_CREDITS)
        .with_user_data_64(plan.capacity().get())
        .with_user_data_32(plan.window_seconds().get())
}

pub fn grant_transfer(user_account_id: u128, ledger: u32, plan: &Plan) -> tb::Transfer {
    tb::Transfer::new(grant_transfer_id(user_account_id))
        .with_debit_account_id(OPERATOR_ACCOUNT_ID)
        .with_credit_account_id(user_account_id)
        .with_amount(plan.capacity().get().into())
        .with_ledger(ledger)
        .with_code(TRANSFER_CODE_GRANT)
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
        .with_credit_account_id(OPERATOR_ACCOUNT_ID)
        .with_amount(amount.into())
        .with_ledger(ledger)
        .with_code(TRANSFER_CODE_REQUEST)
        .with_flags(tb::transfer::Flags::PENDING)
        .with_timeout(timeout_seconds)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::test_plan as plan;
    use proptest::prelude::*;

    fn key(k: &str) -> CallerKey {
        CallerKey::from_header_value("x-api-key", k.as_bytes(), 128).unwrap()
    }

    #[test]
    fn ids_are_deterministic_and_distinct() {
        let free = plan("free", 5);
        let a = user_account_id(LEDGER_REQUEST_RATE, &free, &key("a"));
        assert_eq!(a, user_account_id(LEDGER_REQUEST_RATE, &free, &key("a")));
        assert_ne!(a, user_account_id(LEDGER_REQUEST_RATE, &free, &key("b")));
        assert_ne!(
            a,
            user_account_id(LEDGER_REQUEST_RATE, &plan("pro", 5), &key("a"))
        );
        assert_ne!(
            a,
            user_account_id(LEDGER_REQUEST_RATE, &plan("free", 6), &key("a"))
        );
        assert_ne!(a, user_account_id(2, &free, &key("a")));
        assert_ne!(grant_transfer_id(a), a);
        assert_eq!(grant_transfer_id(a), grant_transfer_id(a));
    }

    proptest! {
        #[test]
        fn user_ids_never_collide_with_reserved_ids(k in "[!-~]{1,64}", ledger in any::<u32>()) {
            let id = user_account_id(ledger, &plan("free", 5), &key(&k));
            prop_assert!(id != 0 && id != u128::MAX && id != OPERATOR_ACCOUNT_ID);
            prop_assert!(id & USER_ID_BIT != 0);
            let grant = grant_transfer_id(id);
            prop_assert!(grant != 0 && grant != u128::MAX);
        }
    }
}
