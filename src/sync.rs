//! Locks that outlive a panic elsewhere.
//!
//! Every structure behind these locks is bookkeeping beside the ledger (caches of derived ids,
//! the local view, lease books, batches being filled, metric cells), and each critical section
//! leaves it whole before it can panic. A panic in one request must not turn every later request
//! of the process into a panic too, so a poisoned lock is taken as it is: the ledger stays the
//! truth, and the worst a stale entry does is cost one more ledger call.

use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

pub(crate) fn read<T>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(|e| e.into_inner())
}

pub(crate) fn write<T>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_is_still_taken() {
        let mutex = Mutex::new(1);
        let rw = RwLock::new(2);
        std::thread::scope(|s| {
            let _ = s
                .spawn(|| {
                    let _m = mutex.lock().unwrap();
                    let _w = rw.write().unwrap();
                    panic!("poison both");
                })
                .join();
        });
        assert!(mutex.is_poisoned() && rw.is_poisoned());
        *lock(&mutex) += 1;
        *write(&rw) += 1;
        assert_eq!((*lock(&mutex), *read(&rw)), (2, 3));
    }
}
