//! Callers' account ids, remembered where that pays: an account id is a SHA-256 of the key and
//! its plan (`model::user_account_id`), 102 ns in a timing loop on a CPU with SHA instructions
//! (`sha_ni`, which `sha2` uses when present; its portable code took 312 ns on the same CPU, still
//! less than the shared level's lookup took under load, below). Each thread keeps the ids of the
//! keys it used last, so a hot caller (hundreds of requests a second, the lease and
//! refusal-from-memory paths) hashes its key once per thread and then pays one lookup in memory
//! its own thread keeps warm.
//!
//! Why each thread's own map and nothing shared behind it: an earlier shared level (sharded maps
//! under locks, every id this instance had seen) cost more than the hash it saved for the callers
//! that reached it. A caller that misses a thread's map is one the thread has not seen for
//! a while, and its shard was then cold too: the lock's cache line last written by the other
//! worker, the table's control bytes, the entry and the key it compares against, four cache
//! misses where the hash has none. Under `wrk -c64` with 10,000 callers in turn, `perf` put
//! 0.58 µs per request in the lookup with its shared level on this machine, and 0.37 µs in the
//! lookup and the hash without it (BENCHMARKS.md, run W). A thread's own map is written by that
//! thread only, so a hot caller's lookup touches no cache line another worker writes.
//!
//! Bounded: at most [`NEAR_KEYS_MAX`] keys per thread over all plans; a full map is emptied
//! rather than grown (a flood of new keys costs hashing again, never memory). A forgotten id is
//! derived again to the same value, so forgetting cannot change a decision: an id depends on the
//! key and the plan only.
//!
//! A full map is not emptied at its next miss but after [`NEAR_REFILL_MISSES`] of them. Why: with
//! more callers than it holds, each in turn (10,000 callers round-robin), every request missed
//! it, and each miss copied its key into the map and every 1,024th emptied it: an allocation and
//! a free per request for ids that were never read again. Now most misses only hash; a hot caller
//! that arrives while the map is full waits for the next refill.

use std::cell::RefCell;
use std::collections::HashMap;

use thread_local::ThreadLocal;

use super::plan::PlanId;

/// Keys each thread remembers (over all plans): the hot ones, not all.
pub const NEAR_KEYS_MAX: usize = 1024;
/// Misses a full map takes before it is emptied and filled again.
pub const NEAR_REFILL_MISSES: usize = 4 * NEAR_KEYS_MAX;

/// Its `Debug` shows how many plans it covers, never the keys.
pub struct AccountIds {
    plan_count: usize,
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
        f.debug_struct("AccountIds")
            .field("plan_count", &self.plan_count)
            .finish_non_exhaustive()
    }
}

impl AccountIds {
    pub fn new(plan_count: usize) -> Self {
        AccountIds {
            plan_count,
            near: ThreadLocal::new(),
        }
    }

    /// The id `key` has on `plan`, from this thread's memory, else from `derive` (and then
    /// remembered, unless the thread's map is full).
    pub fn get_or_derive(&self, plan: PlanId, key: &[u8], derive: impl FnOnce() -> u128) -> u128 {
        let index = plan.index();
        if index >= self.plan_count {
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
        let id = derive();
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
        let ids = AccountIds::new(2);
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
    fn each_thread_remembers_its_own_and_stays_bounded() {
        let ids = AccountIds::new(1);
        assert_eq!(ids.get_or_derive(plan(0), b"hot", || 42), 42);
        std::thread::scope(|s| {
            s.spawn(|| {
                // Another thread has not seen "hot": it derives the id itself.
                let calls = Cell::new(0);
                let derive = || {
                    calls.set(calls.get() + 1);
                    42
                };
                assert_eq!(ids.get_or_derive(plan(0), b"hot", derive), 42);
                assert_eq!(
                    ids.get_or_derive(plan(0), b"hot", || unreachable!("kept")),
                    42
                );
                assert_eq!(calls.get(), 1);
                for n in 0..(NEAR_REFILL_MISSES as u128 * 3) {
                    let key = format!("k{n}");
                    assert_eq!(ids.get_or_derive(plan(0), key.as_bytes(), || n), n);
                    assert!(ids.near.get().unwrap().borrow().keys <= NEAR_KEYS_MAX);
                }
            });
        });
        // This thread's own map still has "hot", and nothing else.
        let near = ids.near.get().unwrap().borrow();
        assert_eq!(near.by_plan[0].get(&b"hot"[..]), Some(&42));
        assert_eq!(near.keys, 1);
    }

    #[test]
    fn a_full_map_refills_after_its_misses_not_at_each() {
        let ids = AccountIds::new(1);
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
        // Misses on a full map derive and copy nothing, up to the refill.
        for n in 0..NEAR_REFILL_MISSES - 1 {
            let k = key(NEAR_KEYS_MAX + n);
            let id = (NEAR_KEYS_MAX + n) as u128;
            assert_eq!(ids.get_or_derive(plan(0), k.as_bytes(), || id), id);
            assert!(!in_near(&k));
        }
        assert_eq!(near_keys(), NEAR_KEYS_MAX);
        assert!(in_near("k0"), "the map kept what it held");
        let kept = ids.get_or_derive(plan(0), b"k0", || unreachable!("kept"));
        assert_eq!(kept, 0);
        // The next miss empties it, and its key is the first of the new ones.
        assert_eq!(ids.get_or_derive(plan(0), b"hot", || 42), 42);
        assert_eq!(near_keys(), 1);
        assert!(in_near("hot") && !in_near("k0"));
        // A forgotten key is derived again, to what the derivation says.
        assert_eq!(ids.get_or_derive(plan(0), b"k0", || 0), 0);
    }
}
