//! Counters counted per thread, added to their `metrics` counters when drained.
//!
//! Why: a `metrics` counter is one atomic (and its recency generation) that every worker
//! increments; for a request decided in memory, moving those cache lines between cores was
//! the largest shared cost left (`perf`: 0.13 µs of a lease admission, two counters). Here each
//! thread adds to cells of its own, and [`ThreadCounts::drain`] moves them to the counters:
//! before every scrape of `/metrics`, so a scrape sees every decision made before it.
//!
//! Bounded lag without a scrape (a library user with another exporter): a cell that reaches
//! [`SPILL_COUNT`] is moved by its own thread. Nothing is lost or counted twice: a cell only ever
//! changes by atomic add and swap.

use std::sync::atomic::{AtomicU64, Ordering};

use metrics::Counter;
use thread_local::ThreadLocal;

/// A thread's count that it moves to the counter itself, without waiting for a drain.
pub const SPILL_COUNT: u64 = 64;

/// Counters, by index, and each thread's counts not yet in them.
pub struct ThreadCounts {
    counters: Box<[Counter]>,
    pending: ThreadLocal<Box<[AtomicU64]>>,
}

impl ThreadCounts {
    pub fn new(counters: Vec<Counter>) -> Self {
        ThreadCounts {
            counters: counters.into_boxed_slice(),
            pending: ThreadLocal::new(),
        }
    }

    /// Counts `n` on counter `index` (none when out of range: a plan of another book).
    pub fn add(&self, index: usize, n: u64) {
        let Some(counter) = self.counters.get(index) else {
            return;
        };
        let cells = self.pending.get_or(|| {
            let cells: Vec<AtomicU64> = self.counters.iter().map(|_| AtomicU64::new(0)).collect();
            cells.into_boxed_slice()
        });
        let cell = &cells[index];
        if cell.fetch_add(n, Ordering::Relaxed) + n >= SPILL_COUNT {
            counter.increment(cell.swap(0, Ordering::Relaxed));
        }
    }

    /// Moves every thread's counts to the counters.
    pub fn drain(&self) {
        for cells in self.pending.iter() {
            for (cell, counter) in cells.iter().zip(self.counters.iter()) {
                if cell.load(Ordering::Relaxed) > 0 {
                    counter.increment(cell.swap(0, Ordering::Relaxed));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn counts(n: usize) -> (ThreadCounts, Vec<Arc<AtomicU64>>) {
        let shared: Vec<Arc<AtomicU64>> = (0..n).map(|_| Arc::new(AtomicU64::new(0))).collect();
        let counters = shared
            .iter()
            .map(|c| Counter::from_arc(c.clone()))
            .collect();
        (ThreadCounts::new(counters), shared)
    }

    fn value(shared: &[Arc<AtomicU64>], index: usize) -> u64 {
        shared[index].load(Ordering::Relaxed)
    }

    #[test]
    fn a_drain_moves_every_threads_counts_and_a_full_cell_moves_itself() {
        let (counts, shared) = counts(2);
        counts.add(0, 1);
        counts.add(7, 1); // out of range: nowhere
        std::thread::scope(|s| {
            s.spawn(|| (0..10).for_each(|_| counts.add(1, 1)));
        });
        assert_eq!((value(&shared, 0), value(&shared, 1)), (0, 0));
        counts.drain();
        assert_eq!((value(&shared, 0), value(&shared, 1)), (1, 10));
        (0..SPILL_COUNT).for_each(|_| counts.add(0, 1));
        assert_eq!(
            value(&shared, 0),
            1 + SPILL_COUNT,
            "spilled without a drain"
        );
        counts.drain();
        assert_eq!(value(&shared, 0), 1 + SPILL_COUNT);
    }

    #[test]
    fn drains_while_threads_count_lose_nothing() {
        let (counts, shared) = counts(1);
        let per_thread = 100_000;
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| (0..per_thread).for_each(|_| counts.add(0, 1)));
            }
            s.spawn(|| (0..1_000).for_each(|_| counts.drain()));
        });
        counts.drain();
        assert_eq!(value(&shared, 0), 3 * per_thread);
    }
}
