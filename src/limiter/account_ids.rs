//! Callers' account ids, remembered: an account id is a SHA-256 of the key and its plan
//! (`model::user_account_id`), the costliest step of a refusal from memory or a lease admission.
//! A caller sending thousands of requests pays for the hash once per instance.
//!
//! Two levels: shards shared by every thread, and in front of them each thread's own few
//! ids it used last. Why the second: with the shards alone, every request of a hot caller took
//! the same shard's lock from every worker, and moving that lock's cache line between cores cost
//! more than the lookup: `perf` put most of `get_or_derive`'s time on the lock's `cmpxchg`, and
//! the near level halved it (0.078 to 0.037 µs per request, hot callers, 256 connections). A
//! thread's own map is written by that thread only.
//!
//! Bounded: at most `callers_max` keys over all plans in the shards, and [`NEAR_KEYS_MAX`] per
//! thread; a full map is emptied rather than grown (a flood of new keys costs hashing again,
//! never memory). A forgotten id is derived again to the same value, so neither level can
//! change a decision: an id depends on the key and the plan only.
//!
//! A full near level is not emptied at its next miss but after [`NEAR_REFILL_MISSES`] of them.
//! Why: with more callers than it holds, each in turn (10,000 callers round-robin), every request
//! missed it, and each miss copied its key into the near map and every 1,024th emptied it: an
//! allocation and a free per request for ids that were never read again. Now most misses only
//! read; a hot caller that arrives while the level is full waits for the next refill.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Mutex;

use thread_local::ThreadLocal;

use super::plan::PlanId;
use crate::sync::lock;

const SHARD_COUNT: usize = 16;
/// Keys each thread keeps in front of the shards (over all plans): the hot ones, not all.
pub const NEAR_KEYS_MAX: usize = 1024;
/// Misses a full near level takes before it is emptied and filled again.
pub const NEAR_REFILL_MISSES: usize = 4 * NEAR_KEYS_MAX;

/// Its `Debug` shows how many keys it holds, never the keys.
pub struct AccountIds {
    /// One map per plan and shard: `shards[plan * SHARD_COUNT + shard]`.
    shards: Vec<Mutex<HashMap<Box<[u8]>, u128>>>,
    shard_keys_max: usize,
    /// Each thread's ids, one map per plan.
    near: ThreadLocal<RefCell<Near>>,
}

#[derive(Default)]
struct Near {
    by_plan: Vec<HashMap<Box<[u8]>, u128>>,
    keys: usize,
    /// Misses since it became full.
    misses_full: usize,
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
            near: ThreadLocal::new(),
        }
    }

    /// The id `key` has on `plan`, from memory, else from `derive` (and then remembered).
    pub fn get_or_derive(&self, plan: PlanId, key: &[u8], derive: impl FnOnce() -> u128) -> u128 {
        let index = plan.index();
        if index >= self.shards.len() / SHARD_COUNT {
            return derive(); // a plan of another book: not worth remembering
        }
        let near = self.near.get_or_default();
        if let Some(id) = near
            .borrow()
            .by_plan
            .get(index)
            .and_then(|ids| ids.get(key))
        {
            return *id;
        }
        let id = self.shared(index, key, derive);
        let mut near = near.borrow_mut();
        if near.keys >= NEAR_KEYS_MAX {
            near.misses_full += 1;
            if near.misses_full < NEAR_REFILL_MISSES {
                return id;
            }
            near.by_plan.iter_mut().for_each(HashMap::clear);
            near.keys = 0;
            near.misses_full = 0;
        }
        if near.by_plan.len() <= index {
            near.by_plan.resize_with(index + 1, HashMap::new);
        }
        if near.by_plan[index].insert(key.into(), id).is_none() {
            near.keys += 1;
        }
        id
    }

    /// The shared level: `key`'s id from its shard, else derived and remembered there.
    fn shared(&self, plan_index: usize, key: &[u8], derive: impl FnOnce() -> u128) -> u128 {
        let shard = &self.shards[plan_index * SHARD_COUNT + shard_of(key)];
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
    fn threads_share_what_one_derived_and_keep_their_own_few() {
        let ids = AccountIds::new(1, 100_000);
        assert_eq!(ids.get_or_derive(plan(0), b"hot", || 42), 42);
        std::thread::scope(|s| {
            s.spawn(|| {
                let id = ids.get_or_derive(plan(0), b"hot", || unreachable!("in the shards"));
                assert_eq!(id, 42);
                for n in 0..(NEAR_KEYS_MAX as u128 * 3) {
                    let key = format!("k{n}");
                    assert_eq!(ids.get_or_derive(plan(0), key.as_bytes(), || n), n);
                    assert!(ids.near.get().unwrap().borrow().keys <= NEAR_KEYS_MAX);
                }
            });
        });
        // This thread's own map still has "hot"; the other thread's stays bounded.
        let near = ids.near.get().unwrap().borrow();
        assert_eq!(near.by_plan[0].get(&b"hot"[..]), Some(&42));
        assert_eq!(near.keys, 1);
    }

    #[test]
    fn a_full_near_level_refills_after_its_misses_not_at_each() {
        let ids = AccountIds::new(1, 1_000_000);
        let key = |n: usize| format!("k{n}");
        for n in 0..NEAR_KEYS_MAX {
            ids.get_or_derive(plan(0), key(n).as_bytes(), || n as u128);
        }
        let near_keys = || ids.near.get().unwrap().borrow().keys;
        let in_near = |k: &str| {
            let near = ids.near.get().unwrap().borrow();
            near.by_plan[0].contains_key(k.as_bytes())
        };
        assert_eq!(near_keys(), NEAR_KEYS_MAX);
        // Misses on a full level read the shards and copy nothing, up to the refill.
        for n in 0..NEAR_REFILL_MISSES - 1 {
            let k = key(NEAR_KEYS_MAX + n);
            let id = (NEAR_KEYS_MAX + n) as u128;
            assert_eq!(ids.get_or_derive(plan(0), k.as_bytes(), || id), id);
            assert!(!in_near(&k));
        }
        assert_eq!(near_keys(), NEAR_KEYS_MAX);
        assert!(in_near("k0"), "the level kept what it held");
        // The next miss empties it, and its key is the first of the new ones.
        assert_eq!(ids.get_or_derive(plan(0), b"hot", || 42), 42);
        assert_eq!(near_keys(), 1);
        assert!(in_near("hot") && !in_near("k0"));
        // The shards still know every id: nothing is derived again.
        let again = ids.get_or_derive(plan(0), b"k0", || unreachable!("in the shards"));
        assert_eq!(again, 0);
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
