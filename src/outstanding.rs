//! Work a worker hands out that must end even when its worker's runtime goes first: counted until
//! it ends, with the runtime the service was made on (its main one, which outlives its workers)
//! to run it on. A stop waits for the count once its server has ended ([`Outstanding::back`]).
//!
//! Why: a stop's drain ends each worker's runtime, and drops every task still on it unrun. A
//! concurrency slot's give-back dropped so held the slot until its timeout (its caller refused,
//! across a rolling deploy); a lease's renewal ahead dropped so left the lease it had just taken
//! at the ledger unknown to every instance, its units held window + L.
//!
//! The ledger counts a move's second pass running in the background the same way (no runtime to
//! run it on there): the CLI's move, a process that ends with its command, waits for it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Work counted out and not ended yet, and the runtime it was made on.
#[derive(Clone, Default)]
pub struct Outstanding(Arc<Out>);

#[derive(Default)]
struct Out {
    /// Counted out, not ended yet.
    count: AtomicUsize,
    /// The runtime this was made on; `None` outside a runtime.
    home: Option<tokio::runtime::Handle>,
}

impl Outstanding {
    /// Made on the current runtime, if any: the one [`OutGuard::home`] names.
    pub(crate) fn here() -> Self {
        Outstanding(Arc::new(Out {
            count: AtomicUsize::new(0),
            home: tokio::runtime::Handle::try_current().ok(),
        }))
    }

    /// Counts one out, until the guard is dropped.
    pub(crate) fn count_out(&self) -> OutGuard {
        self.0.count.fetch_add(1, Ordering::Relaxed);
        OutGuard(self.0.clone())
    }

    /// Waits until everything counted out has ended, or `within`: how many have not.
    pub async fn back(&self, within: Duration) -> usize {
        let until = Instant::now() + within;
        loop {
            let out = self.0.count.load(Ordering::Relaxed);
            if out == 0 || Instant::now() >= until {
                return out;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// One counted out ([`Outstanding`]), until dropped.
pub(crate) struct OutGuard(Arc<Out>);

impl OutGuard {
    /// The runtime its [`Outstanding`] was made on, if any.
    pub(crate) fn home(&self) -> Option<&tokio::runtime::Handle> {
        self.0.home.as_ref()
    }
}

impl Drop for OutGuard {
    fn drop(&mut self) {
        self.0.count.fetch_sub(1, Ordering::Relaxed);
    }
}
