//! Callers' account ids, remembered: an account id is a SHA-256 of the key and its plan
//! (`model::user_account_id`), the costliest step of a refusal from memory or a lease admission.
//! A caller sending thousands of requests pays for the hash once per instance.
//!
//! Bounded: at most `callers_max` keys over all plans; a full shard is emptied rather than
//! grown (a flood of new keys costs hashing again, never memory). A forgotten id is derived again
//! to the same value, so forgetting never changes a decision.

use std::collections::HashMap;
use std::sync::Mutex;

use super::plan::PlanId;
use crate::sync::lock;

const SHARD_COUNT: usize = 16;

/// Its `Debug` shows how many keys it holds, never the keys.
pub struct AccountIds {
    /// One map per plan and shard: `shards[plan * SHARD_COUNT + shard]`.
    shards: Vec<Mutex<HashMap<Box<[u8]>, u128>>>,
    shard_keys_max: usize,
}

impl std::fmt::Debug for AccountIds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let keys: usize = self.shards.iter().map(|shard| lock(shard).len()).sum();
        f.debug_struct("AccountIds").field("keys", &keys).finish()
    }
}

impl AccountIds {
    pub fn new(plan_count: usize, callers_max: usize) -> Self {
        let shard_count = plan_count.max(1) * SHARD_COUNT;
        AccountIds {
            shards: (0..shard_count).map(|_| Mutex::default()).collect(),
            shard_keys_max: (callers_max / shard_count).max(1),
        }
    }

    /// The id `key` has on `plan`, from memory, else from `derive` (and then remembered).
    pub fn get_or_derive(&self, plan: PlanId, key: &[u8], derive: impl FnOnce() -> u128) -> u128 {
        let Some(shard) = self.shards.get(plan.index() * SHARD_COUNT + shard_of(key)) else {
            return derive(); // a plan of another book: not worth remembering
        };
        if let Some(id) = lock(shard).get(key) {
            return *id;
        }
        // Derived outside the lock: the other worker may hash another key meanwhile.
        let id = derive();
        let mut ids = lock(shard);
        if ids.len() >= self.shard_keys_max {
            ids.clear();
        }
        ids.insert(key.into(), id);
        id
    }
}

/// Keys often share a prefix (`tenant_00001`): the length and the last bytes spread them.
fn shard_of(key: &[u8]) -> usize {
    let last = key.last().copied().unwrap_or(0);
    let before = key.len().checked_sub(2).map_or(0, |i| key[i]);
    (usize::from(last) ^ usize::from(before).rotate_left(3) ^ key.len()) % SHARD_COUNT
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    fn plan(index: usize) -> PlanId {
        PlanId::from_index(index)
    }

    #[test]
    fn derives_once_per_key_and_plan() {
        let ids = AccountIds::new(2, 1_000);
        let calls = &Cell::new(0);
        let derive = |id| {
            move || {
                calls.set(calls.get() + 1);
                id
            }
        };
        assert_eq!(ids.get_or_derive(plan(0), b"alice", derive(7)), 7);
        assert_eq!(ids.get_or_derive(plan(0), b"alice", derive(99)), 7);
        assert_eq!(ids.get_or_derive(plan(1), b"alice", derive(8)), 8);
        assert_eq!(ids.get_or_derive(plan(0), b"bob", derive(9)), 9);
        assert_eq!(calls.get(), 3);
        // A plan this book does not have is derived every time, not remembered.
        assert_eq!(ids.get_or_derive(plan(5), b"alice", derive(10)), 10);
        assert_eq!(ids.get_or_derive(plan(5), b"alice", derive(11)), 11);
    }

    #[test]
    fn stays_within_its_bound() {
        let ids = AccountIds::new(1, SHARD_COUNT * 4);
        for n in 0..10_000u32 {
            let key = format!("k{n}");
            let id = u128::from(n);
            assert_eq!(ids.get_or_derive(plan(0), key.as_bytes(), || id), id);
        }
        for shard in &ids.shards {
            assert!(lock(shard).len() <= 4);
        }
        // Forgotten keys are derived again, to what the derivation says.
        assert_eq!(ids.get_or_derive(plan(0), b"k1", || 1), 1);
    }
}
