//! Lease mode (opt-in per plan): a hot caller's requests admitted from leased credit in memory.
//!
//! An instance takes one pending transfer of `k` units (a *lease*, timeout = window + L), admits
//! the caller's requests from it in memory for at most L, then *settles* it: one linked chain
//! voids the lease and holds exactly the units used, for a window.
//!
//! Why it never over-admits (the invariant: at every instant, the units the ledger holds for a
//! caller are at least the units admitted to it in the last window):
//! - A lease is stamped by the ledger at `T0 ≥ sent_at` (the ledger stamps what it received) and
//!   released no earlier than `T0 + window + L`. Requests are admitted from it only before
//!   `sent_at + L`, so a unit admitted at `t < sent_at + L` stays held until at least
//!   `t + window`, and never more units than the lease holds.
//! - The settlement is stamped at `S ≥` its sending, which is after every admission from the lease
//!   (the caller's lease is locked meanwhile), and holds the used units until `S + window`: each
//!   unit stays held at least a window after its admission. Void and hold are one linked chain,
//!   so no instant sees the units released and not yet held again.
//! - A settlement that fails or is lost leaves the lease pending; it covers every unit until
//!   `T0 + window + L`. A lease found expired needs nothing: its units are out of the window.
//!   An instance that dies leaves its lease to expire the same way.
//!
//! The cost is a bounded over-hold: a unit admitted at `t` may stay held until `t + window + L`
//! (the lease, or a settlement sent up to L after `t`), and other instances may see the caller's
//! unused leased units as held for up to L (settlement is due L after the lease was sent; a sweeper
//! settles idle leases within [`SETTLE_TICK`] of that). Each lease takes at most half of what the
//! local view knows to be left (fairness across instances) and at most the plan's
//! `lease_units_max`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use metrics::{counter, describe_counter, Counter};
use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

use super::local_view::LocalQuota;
use super::plan::{LeaseTerms, PlanBook, PlanId};
use super::store::{Clock, Store};
use super::{Charge, HoldReceipt, Limiter, Outcome};
use crate::ledger::lease::{Settled, Settlement};
use crate::ledger::metrics::Operation;
use crate::ledger::{HoldReply, LedgerError};

/// Callers with lease state per instance; beyond, a caller is decided per request (still exact).
pub const LEASE_CALLERS_MAX: usize = 16_384;
/// The first lease of a caller (then doubled while it runs out before L).
pub const LEASE_UNITS_FIRST: u64 = 8;
/// How often the sweeper settles leases whose time L is over (so idle leases give credit back).
pub const SETTLE_TICK: Duration = Duration::from_millis(100);
/// Leases settled at once by one sweep, so a sweep's ledger calls stay bounded.
const SETTLE_BATCH_MAX: usize = 256;
const SHARD_COUNT: usize = 16;

/// Units leased and requests admitted from them, by plan: `lease_transfers_total` over the
/// plan's admitted decisions is the ledger transfers per admitted request.
pub const LEASE_ADMITTED_TOTAL: &str = "ledger_limiter_lease_admitted_total";
pub const LEASE_TRANSFERS_TOTAL: &str = "ledger_limiter_lease_transfers_total";

type Decided = (Outcome, LocalQuota, Option<HoldReceipt>);
/// Callers by account id; each locked (asynchronously) for the whole of a renewal.
type Shard = HashMap<u128, Arc<AsyncMutex<CallerLease>>>;

/// One lease this instance holds for a caller.
#[derive(Debug, Clone, Copy)]
struct Lease {
    transfer_id: u128,
    units: u64,
    units_used: u64,
    requests: u64,
    /// No admission at or after this (`sent_at + L`): see the module's proof.
    admit_until: Instant,
    /// The expiry the local view recorded for the lease (to forget it once settled).
    local_expires_at: Instant,
}

/// A caller's lease state on this instance, locked for the whole of a renewal.
#[derive(Debug)]
pub(super) struct CallerLease {
    account_id: u128,
    plan_id: PlanId,
    capacity: u64,
    window_seconds: u32,
    terms: LeaseTerms,
    lease: Option<Lease>,
    /// The next lease's size, from this caller's demand on this instance.
    next_units: u64,
    /// Sweeps that found no lease: the caller is forgotten after two.
    idle_sweeps: u8,
}

impl CallerLease {
    /// Admits `cost` from the lease, in memory, if it has the units and its time is not over.
    fn admit(&mut self, cost: u64, now: Instant) -> bool {
        let Some(lease) = &mut self.lease else {
            return false;
        };
        if now >= lease.admit_until || lease.units_used + cost > lease.units {
            return false;
        }
        lease.units_used += cost;
        lease.requests += 1;
        assert!(lease.units_used <= lease.units);
        true
    }

    /// Sizes the next lease from how the current one went: doubled when it ran out before L,
    /// twice what was used when L ran out first.
    fn resize(&mut self, now: Instant) {
        if let Some(lease) = &self.lease {
            let ran_out = now < lease.admit_until;
            let wanted = if ran_out {
                lease.units * 2
            } else {
                lease.units_used * 2
            };
            self.next_units = wanted.clamp(1, self.terms.units_max.get());
        }
    }

    fn settlement(&self, lease: &Lease) -> Settlement {
        Settlement {
            account_id: self.account_id,
            lease_id: lease.transfer_id,
            units_used: lease.units_used,
            requests: lease.requests,
            window_seconds: self.window_seconds,
        }
    }
}

/// Per plan: requests admitted from leases, and ledger transfers made for the plan's callers.
struct LeaseMetrics {
    admitted: Vec<Counter>,
    transfers: Vec<Counter>,
}

impl LeaseMetrics {
    fn register(plans: &PlanBook) -> Self {
        describe_counter!(
            LEASE_ADMITTED_TOTAL,
            "Requests admitted from a lease in memory, by plan"
        );
        describe_counter!(
            LEASE_TRANSFERS_TOTAL,
            "Ledger transfers sent for callers of lease plans (leases, settlements, per-request holds), by plan"
        );
        let per_plan = |name: &'static str| {
            plans
                .plans()
                .iter()
                .map(|plan| counter!(name, "plan" => plan.name().to_owned()))
                .collect()
        };
        LeaseMetrics {
            admitted: per_plan(LEASE_ADMITTED_TOTAL),
            transfers: per_plan(LEASE_TRANSFERS_TOTAL),
        }
    }
}

/// Every caller's lease state on this instance (bounded by [`LEASE_CALLERS_MAX`]).
pub(super) struct LeaseBook {
    shards: Box<[Mutex<Shard>]>,
    metrics: LeaseMetrics,
}

impl LeaseBook {
    pub(super) fn new(plans: &PlanBook) -> Self {
        let shards = (0..SHARD_COUNT)
            .map(|_| Mutex::new(HashMap::new()))
            .collect();
        LeaseBook {
            shards,
            metrics: LeaseMetrics::register(plans),
        }
    }

    fn shard(&self, account_id: u128) -> MutexGuard<'_, Shard> {
        let index = (account_id as usize) % SHARD_COUNT;
        self.shards[index].lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The caller's lease state; `None` when the book is full (the caller is decided per request).
    fn slot(&self, charge: &Charge<'_>, terms: LeaseTerms) -> Option<Arc<AsyncMutex<CallerLease>>> {
        let mut shard = self.shard(charge.account.id);
        if let Some(slot) = shard.get(&charge.account.id) {
            return Some(slot.clone());
        }
        if shard.len() >= LEASE_CALLERS_MAX / SHARD_COUNT {
            return None;
        }
        let caller = CallerLease {
            account_id: charge.account.id,
            plan_id: charge.plan_id,
            capacity: charge.account.capacity.get(),
            window_seconds: charge.account.window_seconds.get(),
            terms,
            lease: None,
            next_units: LEASE_UNITS_FIRST.min(terms.units_max.get()),
            idle_sweeps: 0,
        };
        let slot = Arc::new(AsyncMutex::new(caller));
        shard.insert(charge.account.id, slot.clone());
        Some(slot)
    }

    fn count_transfers(&self, plan_id: PlanId, transfers: u64) {
        if let Some(counter) = self.metrics.transfers.get(plan_id.index()) {
            counter.increment(transfers);
        }
    }

    /// Callers whose lease time is over and that nobody is deciding for right now; callers idle
    /// for two sweeps are forgotten.
    fn due(&self, now: Instant) -> Vec<OwnedMutexGuard<CallerLease>> {
        let mut due = Vec::new();
        for shard in self.shards.iter() {
            let mut shard = shard.lock().unwrap_or_else(|e| e.into_inner());
            shard.retain(|_, slot| {
                let Ok(mut caller) = slot.clone().try_lock_owned() else {
                    return true;
                };
                match caller.lease {
                    Some(lease) if now >= lease.admit_until && due.len() < SETTLE_BATCH_MAX => {
                        due.push(caller);
                        true
                    }
                    Some(_) => true,
                    None => {
                        caller.idle_sweeps += 1;
                        // Only the book holds it (checked under the shard lock, where `slot`
                        // clones it): no request is about to lock a forgotten caller.
                        caller.idle_sweeps < 2 || Arc::strong_count(slot) > 1
                    }
                }
            });
        }
        due
    }
}

impl<S: Store, C: Clock> Limiter<S, C> {
    /// A decision on a lease plan: from the caller's lease in memory when it has room; else the
    /// lease is settled and a new one taken; per request (exact, as without leases) when no lease
    /// can be had. Everything by `started + ledger_timeout`.
    pub(super) async fn decide_leased(
        &self,
        charge: &Charge<'_>,
        terms: LeaseTerms,
        started: Instant,
    ) -> Decided {
        let slot = match self.leases.slot(charge, terms) {
            Some(slot) if charge.cost <= terms.units_max.get() => slot,
            _ => return self.decide_per_request_counted(charge, started).await,
        };
        let deadline = started + self.settings.ledger_timeout;
        let Ok(mut caller) = tokio::time::timeout_at(deadline.into(), slot.lock()).await else {
            let error = LedgerError::Timeout {
                operation: Operation::CreateTransfers,
            };
            let (outcome, local) = self.fail(error, charge);
            return (outcome, local, None);
        };
        let now = self.clock.now();
        if caller.admit(charge.cost, now) {
            return self.admitted_from_lease(&caller, now);
        }
        caller.resize(now);
        if let Some(lease) = caller.lease.take() {
            self.settle(&caller, lease, deadline).await;
        }
        match self.renew(&mut caller, charge, deadline).await {
            Ok(true) => {
                let now = self.clock.now();
                if caller.admit(charge.cost, now) {
                    return self.admitted_from_lease(&caller, now);
                }
                // L ran out while the ledger answered: this one is decided per request.
            }
            Ok(false) => {}
            Err(error) => {
                let (outcome, local) = self.fail(error, charge);
                return (outcome, local, None);
            }
        }
        drop(caller);
        self.decide_per_request_counted(charge, started).await
    }

    /// Per request, on a lease plan: counts the hold (for the transfers-per-request metric).
    async fn decide_per_request_counted(&self, charge: &Charge<'_>, started: Instant) -> Decided {
        let decided = self.decide_per_request(charge, started).await;
        if decided.2.is_some() {
            self.leases.count_transfers(charge.plan_id, 1);
        }
        decided
    }

    /// Takes a new lease: `Ok(true)` when taken, `Ok(false)` when the caller should be decided
    /// per request (credit too low for a lease, or a new caller to provision).
    async fn renew(
        &self,
        caller: &mut CallerLease,
        charge: &Charge<'_>,
        deadline: Instant,
    ) -> Result<bool, LedgerError> {
        let sent_at = self.clock.now();
        let id = caller.account_id;
        // The local view's remaining credit is an upper bound of the ledger's: a lease larger than
        // half of it would fail, or starve other instances.
        let remaining = self.local.quota(id, caller.capacity, sent_at).remaining;
        if remaining < charge.cost {
            return Ok(false);
        }
        let units = caller.next_units.min(remaining / 2).max(charge.cost);
        assert!(units >= charge.cost && units <= caller.terms.units_max.get());
        let lease_seconds = caller.terms.seconds.get();
        let timeout_seconds = caller.window_seconds.saturating_add(lease_seconds);
        let reply = self
            .store
            .take_lease(id, units, timeout_seconds, deadline)
            .await?;
        self.leases.count_transfers(caller.plan_id, 1);
        let (answered_at, transfer_id) = match reply {
            HoldReply::Held {
                answered_at,
                transfer_id,
            } => (answered_at, transfer_id),
            HoldReply::ExceedsCredits => {
                caller.next_units = (units / 2).max(1);
                return Ok(false);
            }
            HoldReply::AccountNotFound => return Ok(false),
        };
        let timeout = Duration::from_secs(timeout_seconds.into());
        self.local.record_hold(
            id,
            caller.capacity,
            units,
            answered_at,
            timeout,
            self.clock.now(),
        );
        caller.lease = Some(Lease {
            transfer_id,
            units,
            units_used: 0,
            requests: 0,
            admit_until: sent_at + Duration::from_secs(lease_seconds.into()),
            local_expires_at: answered_at + timeout + self.settings.expiry_margin,
        });
        caller.idle_sweeps = 0;
        Ok(true)
    }

    /// Settles `lease` (taken out of `caller`). On an error the outcome is unknown and both are
    /// safe: the lease is left to expire, which holds every unit it admitted long enough.
    async fn settle(&self, caller: &CallerLease, lease: Lease, deadline: Instant) {
        assert!(lease.units_used <= lease.units);
        let settlement = caller.settlement(&lease);
        let transfers = if lease.units_used == 0 { 1 } else { 2 };
        let result = self.store.settle_lease(settlement, deadline).await;
        self.leases.count_transfers(caller.plan_id, transfers);
        match result {
            Ok(Settled::Done) => {
                let id = caller.account_id;
                self.local.release(id, lease.units, lease.local_expires_at);
                if lease.units_used > 0 {
                    let now = self.clock.now();
                    let window = Duration::from_secs(caller.window_seconds.into());
                    self.local
                        .record_hold(id, caller.capacity, lease.units_used, now, window, now);
                }
            }
            // Expired: its units are out of every window that needed them; the local view forgets
            // it at its recorded expiry.
            Ok(Settled::LeaseGone) => {}
            Err(error) => {
                tracing::debug!(%error, "could not settle a lease; it expires window + L after it was placed");
            }
        }
    }

    fn admitted_from_lease(&self, caller: &CallerLease, now: Instant) -> Decided {
        if let Some(counter) = self.leases.metrics.admitted.get(caller.plan_id.index()) {
            counter.increment(1);
        }
        let local = self.local.quota(caller.account_id, caller.capacity, now);
        let unused = caller.lease.map_or(0, |l| l.units - l.units_used);
        let quota = LocalQuota {
            // The lease counts as held in the local view; its unused units are still this
            // caller's to spend here.
            remaining: local.remaining.saturating_add(unused).min(caller.capacity),
            reset_after: local.reset_after,
        };
        (Outcome::Admitted, quota, None)
    }

    /// Settles every lease whose time L is over (at most a batch per call): the sweeper calls it
    /// every [`SETTLE_TICK`], so unused leased units return about L after the lease was taken
    /// even when the caller stopped sending. Returns how many it settled.
    pub async fn settle_due_leases(&self) -> usize {
        let now = self.clock.now();
        let due = self.leases.due(now);
        let count = due.len();
        let deadline = now + self.settings.ledger_timeout;
        let settlements = due.into_iter().map(|mut caller| async move {
            caller.resize(now);
            if let Some(lease) = caller.lease.take() {
                self.settle(&caller, lease, deadline).await;
            }
        });
        futures_util::future::join_all(settlements).await;
        count
    }
}

/// Starts the sweeper that settles leases whose time is over, if any plan has leases. It holds
/// the limiter weakly: dropping the limiter ends it (and leaves leases to expire on their own).
pub fn spawn_settler<S: Store, C: Clock>(
    limiter: &Arc<Limiter<S, C>>,
) -> Option<tokio::task::JoinHandle<()>> {
    if !limiter.plans().plans().iter().any(|p| p.lease().is_some()) {
        return None;
    }
    let weak: Weak<Limiter<S, C>> = Arc::downgrade(limiter);
    Some(tokio::spawn(async move {
        let mut tick = tokio::time::interval(SETTLE_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(limiter) = weak.upgrade() else {
                return;
            };
            limiter.settle_due_leases().await;
        }
    }))
}

#[cfg(test)]
mod tests;
