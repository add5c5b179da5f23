//! Answers that repeat. An exhausted caller is refused many times a second, and each refusal
//! carries the same `RateLimit` field and problem body until a second passes. Each worker thread
//! remembers the last few it made, so a repeat costs a reference count instead of formatting and
//! allocating again.
//!
//! The cache is keyed by everything the value is made of (a name and up to four numbers), so a
//! hit is always the value a fresh build would give; a unit test checks that.

use std::cell::RefCell;

use actix_web::http::header::HeaderValue;
use actix_web::web::Bytes;

use crate::limiter::Quota;

/// Slots per thread and per kind of value; a refusal storm from more distinct (plan, second)
/// pairs than this on one worker simply builds the values as before.
const SLOTS_PER_THREAD: usize = 32;

/// What a value was made of.
#[derive(Debug, PartialEq, Eq)]
struct Key {
    name: String,
    numbers: [u64; 4],
}

impl Key {
    fn matches(&self, name: &str, numbers: &[u64; 4]) -> bool {
        self.numbers == *numbers && self.name == name
    }
}

/// A direct-mapped cache: one slot per hash, the newest value wins.
struct Repeats<V> {
    slots: Vec<Option<(Key, V)>>,
}

impl<V: Clone> Repeats<V> {
    fn new() -> Self {
        Repeats {
            slots: (0..SLOTS_PER_THREAD).map(|_| None).collect(),
        }
    }

    fn get_or_make(&mut self, name: &str, numbers: [u64; 4], make: impl FnOnce() -> V) -> V {
        let slot = &mut self.slots[slot_index(name, &numbers)];
        match slot {
            Some((key, value)) if key.matches(name, &numbers) => value.clone(),
            Some((key, value)) => {
                // Reuse the slot's name buffer: no allocation once it is long enough.
                key.name.clear();
                key.name.push_str(name);
                key.numbers = numbers;
                *value = make();
                value.clone()
            }
            None => {
                let value = make();
                let key = Key {
                    name: name.to_owned(),
                    numbers,
                };
                *slot = Some((key, value.clone()));
                value
            }
        }
    }
}

/// FNV-1a over the numbers and the name: cheap, and spreads nearby seconds over the slots.
fn slot_index(name: &str, numbers: &[u64; 4]) -> usize {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for number in numbers {
        hash = (hash ^ number).wrapping_mul(PRIME);
    }
    for byte in name.bytes() {
        hash = (hash ^ u64::from(byte)).wrapping_mul(PRIME);
    }
    (hash % SLOTS_PER_THREAD as u64) as usize
}

thread_local! {
    static RATELIMIT_FIELDS: RefCell<Repeats<HeaderValue>> = RefCell::new(Repeats::new());
    static PROBLEM_BODIES: RefCell<Repeats<Bytes>> = RefCell::new(Repeats::new());
}

/// The `RateLimit` field of an exhausted caller (`r=0`), remembered; `make` builds it on a miss.
/// A caller with credit left gets a new `r` on every request: not worth remembering.
pub fn exhausted_ratelimit_field(
    name: &str,
    quota: &Quota,
    make: impl FnOnce() -> HeaderValue,
) -> HeaderValue {
    debug_assert_eq!(quota.remaining, 0);
    let numbers = [quota.reset_seconds, 0, 0, 0];
    RATELIMIT_FIELDS.with(|cache| cache.borrow_mut().get_or_make(name, numbers, make))
}

/// A 429's problem body for (plan or limit `name`, its quota, `Retry-After`), remembered.
pub fn rate_limited_body(
    what: Refuser,
    name: &str,
    quota: &Quota,
    retry_after_seconds: u64,
    make: impl FnOnce() -> Bytes,
) -> Bytes {
    let numbers = [
        what as u64,
        quota.limit,
        u64::from(quota.window_seconds),
        retry_after_seconds,
    ];
    PROBLEM_BODIES.with(|cache| cache.borrow_mut().get_or_make(name, numbers, make))
}

/// Who refused: the caller's plan, or one of the route's further limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refuser {
    Plan = 0,
    Limit = 1,
}

impl Refuser {
    pub fn as_str(self) -> &'static str {
        match self {
            Refuser::Plan => "plan",
            Refuser::Limit => "limit",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whatever the order of requests, a hit is what a fresh build would give, and the cache
    /// stays within its slots.
    #[test]
    fn a_hit_is_what_a_fresh_build_gives() {
        let mut cache = Repeats::new();
        let mut built = 0;
        let names = ["free", "pro", "free-2", ""];
        for round in 0..3 {
            for (n, name) in names.iter().enumerate() {
                for second in 0..40u64 {
                    let numbers = [second, n as u64, 7, 0];
                    let fresh = format!("{name}/{numbers:?}");
                    let got = cache.get_or_make(name, numbers, || {
                        built += 1;
                        fresh.clone()
                    });
                    assert_eq!(got, fresh, "round {round}");
                }
            }
        }
        assert!((160..=3 * 160).contains(&built), "{built}");
        assert_eq!(cache.slots.len(), SLOTS_PER_THREAD);
        // The same value asked again at once is always a hit.
        let made = cache.get_or_make("pro", [3, 1, 7, 0], || "pro/3".to_owned());
        let again = cache.get_or_make("pro", [3, 1, 7, 0], || unreachable!("a hit"));
        assert_eq!(made, again);
    }

    #[test]
    fn names_are_compared_not_only_hashed() {
        let mut cache = Repeats::new();
        let first = cache.get_or_make("a", [1, 0, 0, 0], || "a".to_owned());
        // Every name that lands on the same slot is told apart by its text.
        let index = slot_index("a", &[1, 0, 0, 0]);
        let other = (0..10_000)
            .map(|i| format!("n{i}"))
            .find(|name| slot_index(name, &[1, 0, 0, 0]) == index)
            .expect("some name shares the slot");
        let second = cache.get_or_make(&other, [1, 0, 0, 0], || other.clone());
        assert_eq!((first.as_str(), second.as_str()), ("a", other.as_str()));
        let third = cache.get_or_make("a", [1, 0, 0, 0], || "a, rebuilt".to_owned());
        assert_eq!(third, "a, rebuilt");
    }
}
