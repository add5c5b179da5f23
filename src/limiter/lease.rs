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
//!   `t + window`, and never more units than the lease holds. "Before `sent_at + L`" by both
//!   of this host's clocks: the monotonic one (`Instant`) stands still while the host is
//!   suspended, the ledger's does not, and a host resumed past the lease's expiry would admit
//!   from units nothing holds any more; the wall clock goes on.
//! - The settlement is stamped at `S ≥` its sending, which is after every admission from the lease
//!   (a lease is taken out of the caller's state, under its lock, before its settlement is sent;
//!   nothing admits from it after), and holds the used units until `S + window`: each
//!   unit stays held at least a window after its admission. A settlement sent again at `S'`
//!   holds them `window` less the whole seconds since its first try `F`, so until at least
//!   `F + window`; `F` too is after every admission. Void and hold are one linked chain,
//!   so no instant sees the units released and not yet held again.
//! - A settlement that fails or is lost leaves the lease pending; it covers every unit until
//!   `T0 + window + L`. A lease found expired needs nothing: its units are out of the window.
//!   An instance that dies leaves its lease to expire the same way.
//!
//! The cost is a bounded over-hold: a unit admitted at `t` may stay held until about
//! `t + window + L + 1 s` (the lease, or a settlement first tried up to L + [`SETTLE_TICK`]
//! after `t`, and sent again holding whole seconds rounded in the caller's favour), and other
//! instances may see the caller's unused leased units as held for up to L (settlement is due L
//! after the lease was sent; a sweeper settles idle leases within [`SETTLE_TICK`] of that). Each
//! lease takes at most half of what the local view knows to be left (fairness across instances;
//! but never less than the request's cost, which may be more than half) and at most the plan's
//! `lease_units_max`.

use std::collections::HashMap;
use std::num::{NonZeroU32, NonZeroU64};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant, SystemTime};

use metrics::{counter, describe_counter, Counter};
use tokio::sync::futures::Notified;
use tokio::sync::Notify;

use super::counts::ThreadCounts;
use super::local_view::{Listing, LocalQuota};
use super::plan::{LeaseTerms, PlanBook, PlanId};
use super::store::{Clock, Store};
use super::{Charge, Decided, LeaseReceipt, Limiter, NotAdmitted, Outcome, Reached, Timing};
use crate::ledger::lease::{Settled, Settlement};
use crate::ledger::model::UserAccount;
use crate::ledger::{HoldReply, LedgerError};
use crate::sync::lock;

/// Callers with lease state per instance; beyond, a caller is decided per request (still exact).
pub const LEASE_CALLERS_MAX: usize = 16_384;
/// The first lease of a caller (then doubled while it runs out before L).
pub const LEASE_UNITS_FIRST: u64 = 8;
/// How often the sweeper settles leases whose time L is over (so idle leases give credit back).
pub const SETTLE_TICK: Duration = Duration::from_millis(100);
/// How long a renewal's word that the account is closed waits for the caller's next request
/// ([`CallerLease::closed_at`]); the renewal read the block into the local view as well
/// (`Limiter::read_closed`), and a moved caller never comes back to this account.
const CLOSED_WORD_KEPT: Duration = Duration::from_secs(60);
/// How long past its due time a lease listed is still taken to be settling ([`settling_soon`]):
/// its sweep, and a slow round trip; later, its instance is taken to be gone.
const SETTLE_LATE_GRACE: Duration = Duration::from_millis(500);
/// The least time a settle of every lease gets, whatever `ledger.timeout_ms`: up to 65 batches.
const SETTLE_ALL_TIME_MIN: Duration = Duration::from_secs(1);
/// Leases settled at once by one sweep, so a sweep's ledger calls stay bounded.
const SETTLE_BATCH_MAX: usize = 256;

/// Settlements a sweep has at the ledger at once, at most ([`Limiter::settle_leases`]): a batch
/// in four rounds, a few milliseconds, well within a tick; tens of thousands a second.
const SETTLE_CONCURRENCY_MAX: usize = 64;
const SHARD_COUNT: usize = 16;

/// Units leased and requests admitted from them, by plan: `lease_transfers_total` over the
/// plan's admitted decisions is the ledger transfers per admitted request.
pub const LEASE_ADMITTED_TOTAL: &str = "ledger_limiter_lease_admitted_total";
pub const LEASE_TRANSFERS_TOTAL: &str = "ledger_limiter_lease_transfers_total";
/// Requests that waited for another request's renewal of their caller's lease, by plan: a hot
/// caller whose leases run out before the next one lands (their latency includes a ledger call).
pub const LEASE_WAITS_TOTAL: &str = "ledger_limiter_lease_waits_total";

/// Callers by account id.
type Shard = HashMap<u128, Arc<Slot>>;

/// How often one request looks at its caller's lease (a renewal, or waiting for another's)
/// before it is decided per request.
const LEASE_ATTEMPTS_MAX: usize = 3;

/// One lease this instance holds for a caller.
#[derive(Debug, Clone, Copy)]
struct Lease {
    transfer_id: u128,
    units: u64,
    units_used: u64,
    requests: u64,
    /// When the lease was sent (taken before sending: the ledger stamps it no earlier).
    sent_at: Instant,
    /// No admission at or after this (`sent_at + L`): see the module's proof.
    admit_until: Instant,
    /// Nor at or after this, by the wall clock (taken with `sent_at`, + L): `Instant` does not
    /// count the time the host is suspended, and the ledger's clock does. A wall clock set back
    /// lengthens nothing (`admit_until` still ends it); one set forward ends it early.
    admit_until_wall: SystemTime,
    /// The expiry the local view recorded for the lease (to forget it once settled).
    local_expires_at: Instant,
    /// Settlements of unknown outcome sent so far (counted to 8), and when the next may go: a
    /// timed-out call keeps its place under the in-flight bound until the ledger answers, so a
    /// retry each sweep (100 ms) piled copies onto a ledger that was slow already.
    unknown_tries: u8,
    retry_not_before: Option<Instant>,
    /// When its settlement was first tried. Nothing is admitted from a lease once it is
    /// settled (it is out of its caller's state by then), so its used units need holding for a
    /// window from this instant, not from a later send ([`Holder::settlement`]).
    settling_since: Option<Instant>,
}

impl Lease {
    /// The local view counts it settled already (a settlement of unknown outcome was sent): a
    /// retry that settles it must not count its used units twice.
    fn counted_settled(&self) -> bool {
        self.unknown_tries > 0
    }
}

/// The longest wait before a settlement of unknown outcome is sent again.
const UNKNOWN_RETRY_WAIT_MAX: Duration = Duration::from_secs(10);

/// Who a lease is for: what settling it needs.
#[derive(Debug, Clone, Copy)]
struct Holder {
    account_id: u128,
    plan_id: PlanId,
    capacity: u64,
    window_seconds: u32,
    terms: LeaseTerms,
}

/// A caller's lease state on this instance, under a short lock (never held across a ledger call).
#[derive(Debug)]
struct CallerLease {
    holder: Holder,
    lease: Option<Lease>,
    /// A request is taking the next lease: others admit from the current one, or wait.
    renewing: bool,
    /// The renewal has started its ledger calls (a renewal ahead is started by its request's
    /// caller, after its answer; until then it is only due).
    renewal_running: bool,
    /// Every lease sent before this was settled while this caller renewed (an operator acted):
    /// the lease the renewal brings, if sent before it too, may predate the act, so it is
    /// settled at once, not installed.
    retire_renewed_before: Option<Instant>,
    /// The next lease's size, from this caller's demand on this instance.
    next_units: u64,
    /// Sweeps that found no lease: the caller is forgotten after two.
    idle_sweeps: u8,
    /// When a request last found no lease and no renewal ([`CallerLease::demand`]).
    unleased_at: Option<Instant>,
    /// When a renewal found the account closed (a block, or a move away): the next request
    /// within [`CLOSED_WORD_KEPT`] is refused as the ledger refused it, whatever the policy.
    /// Why: a renewal ahead runs after its request's answer, and its word was lost; the next
    /// request, decided per request, failed to the policy when its hold failed, and fail-open
    /// admitted the blocked caller.
    closed_at: Option<Instant>,
    /// The ledger refused the last lease asked for (credit held elsewhere), or it was refused a
    /// place under a full in-flight bound: no renewal ahead of need until a lease is taken
    /// again, or each admission from the current lease's second half would ask again, a ledger
    /// call per request.
    refused: bool,
    /// Leases that no longer admit, whose settlement a renewal could not send by its
    /// request's deadline, or whose settlement's outcome is unknown (a timeout, a lost answer):
    /// the sweeper settles them with a deadline of their own, rather than leave their unused
    /// units held for window + L. At most [`HANDED_OVER_MAX`].
    handed_over: Vec<Lease>,
}

/// Leases one caller can have waiting for the sweeper: its own, one a renewal replaced, and
/// settlements sent again after an unknown outcome. Past it, a lease is left to expire.
const HANDED_OVER_MAX: usize = 4;

/// A caller's lease state, and the signal that a renewal ended.
struct Slot {
    state: Mutex<CallerLease>,
    renewed: Notify,
}

impl Slot {
    /// A caller's state before its first lease.
    fn new(holder: Holder) -> Arc<Slot> {
        Arc::new(Slot {
            state: Mutex::new(CallerLease {
                holder,
                lease: None,
                renewing: false,
                renewal_running: false,
                retire_renewed_before: None,
                next_units: LEASE_UNITS_FIRST.min(holder.terms.units_max.get()),
                idle_sweeps: 0,
                unleased_at: None,
                closed_at: None,
                handed_over: Vec::new(),
                refused: false,
            }),
            renewed: Notify::new(),
        })
    }
}

impl Slot {
    fn lock(&self) -> MutexGuard<'_, CallerLease> {
        lock(&self.state)
    }

    /// Ends a renewal (whatever its outcome) and wakes the requests waiting for it.
    fn renewal_ended(&self, caller: &mut CallerLease) {
        assert!(caller.renewing);
        caller.renewing = false;
        caller.retire_renewed_before = None;
        caller.renewal_running = false;
        self.renewed.notify_waiters();
    }
}

impl CallerLease {
    /// Admits `cost` from the lease, in memory, if it has the units and its time is not over
    /// by either clock.
    fn admit(&mut self, cost: u64, (now, wall): (Instant, SystemTime)) -> bool {
        let Some(lease) = &mut self.lease else {
            return false;
        };
        let over = now >= lease.admit_until || wall >= lease.admit_until_wall;
        if over || lease.units_used + cost > lease.units {
            return false;
        }
        lease.units_used += cost;
        lease.requests += 1;
        assert!(lease.units_used <= lease.units);
        true
    }

    /// Whether to take the next lease now, ahead of need: the current one is past half its time
    /// or half its units (so hot callers rarely wait for the ledger).
    fn renew_ahead(&self, now: Instant) -> bool {
        let Some(lease) = &self.lease else {
            return false;
        };
        let half_time = lease.sent_at + (lease.admit_until - lease.sent_at) / 2;
        !self.renewing && !self.refused && (now >= half_time || lease.units_used * 2 >= lease.units)
    }

    /// Whether a request that finds no lease comes soon enough after the last such one (within
    /// L, and before the sweeper forgot the caller, two sweeps idle) to take a lease: a caller's
    /// demand rising. Why not at every first request: a caller's lone request took a lease of
    /// [`LEASE_UNITS_FIRST`] units, three transfers (the lease, its void and the hold of the unit
    /// used) where one does, and held the rest from every instance for L.
    fn demand(&mut self, now: Instant) -> bool {
        let lease_time = Duration::from_secs(self.holder.terms.seconds.get().into());
        let last = self.unleased_at.replace(now);
        last.is_some_and(|at| now.saturating_duration_since(at) < lease_time)
    }

    /// Starts a renewal, sizing the next lease at twice the demand the current one saw over L.
    fn start_renewal(&mut self, now: Instant) {
        assert!(!self.renewing);
        self.renewing = true;
        if let Some(lease) = &self.lease {
            let lease_time = lease.admit_until - lease.sent_at;
            let elapsed = (now - lease.sent_at)
                .max(Duration::from_millis(1))
                .min(lease_time);
            let per_lease_time =
                u128::from(lease.units_used) * lease_time.as_nanos() / elapsed.as_nanos();
            let wanted = u64::try_from(per_lease_time.saturating_mul(2)).unwrap_or(u64::MAX);
            self.next_units = wanted.clamp(1, self.holder.terms.units_max.get());
        }
    }
}

impl Holder {
    fn account(&self) -> UserAccount {
        UserAccount {
            id: self.account_id,
            capacity: NonZeroU64::new(self.capacity).expect("a plan's capacity is not zero"),
            window_seconds: NonZeroU32::new(self.window_seconds)
                .expect("a plan's window is not zero"),
        }
    }

    /// The settlement of `lease`, sent `now`. Its hold of the units used lasts a window from
    /// the first try, whole seconds rounded in its favour (the ledger stamps it no earlier than
    /// `now`, so it ends no sooner than a window after the last admission): a settlement sent
    /// again, seconds later, held them a window from the resend, up to a window past the
    /// bound the README states. At least a second: a timeout of 0 would never end.
    fn settlement(&self, lease: &Lease, now: Instant) -> Settlement {
        let since = lease
            .settling_since
            .expect("a settlement is tried from then on");
        let late_seconds = now.saturating_duration_since(since).as_secs();
        let late_seconds = u32::try_from(late_seconds).unwrap_or(u32::MAX);
        Settlement {
            account_id: self.account_id,
            lease_id: lease.transfer_id,
            units_used: lease.units_used,
            requests: lease.requests,
            window_seconds: self.window_seconds.saturating_sub(late_seconds).max(1),
        }
    }
}

/// Per plan: requests admitted from leases, and ledger transfers made for the plan's callers.
struct LeaseMetrics {
    /// Counted per thread, like the decisions: one per lease admission.
    admitted: ThreadCounts,
    transfers: Vec<Counter>,
    waits: Vec<Counter>,
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
        describe_counter!(
            LEASE_WAITS_TOTAL,
            "Requests that waited for another request's lease renewal, by plan"
        );
        LeaseMetrics {
            admitted: ThreadCounts::new(per_plan(LEASE_ADMITTED_TOTAL)),
            transfers: per_plan(LEASE_TRANSFERS_TOTAL),
            waits: per_plan(LEASE_WAITS_TOTAL),
        }
    }
}

/// Every caller's lease state on this instance (bounded by [`LEASE_CALLERS_MAX`]).
pub(super) struct LeaseBook {
    shards: Box<[Mutex<Shard>]>,
    metrics: LeaseMetrics,
    /// A caller's first request takes a lease, its demand unseen: tests of what a lease does,
    /// once it is taken, start from one (the gate has tests of its own).
    #[cfg(test)]
    lease_at_first_request: bool,
}

impl LeaseBook {
    pub(super) fn new(plans: &PlanBook) -> Self {
        let shards = (0..SHARD_COUNT)
            .map(|_| Mutex::new(HashMap::new()))
            .collect();
        LeaseBook {
            shards,
            metrics: LeaseMetrics::register(plans),
            #[cfg(test)]
            lease_at_first_request: false,
        }
    }

    /// Whether a first request takes a lease without demand seen (tests only).
    fn lease_at_first_request(&self) -> bool {
        #[cfg(test)]
        return self.lease_at_first_request;
        #[cfg(not(test))]
        false
    }

    fn shard(&self, account_id: u128) -> MutexGuard<'_, Shard> {
        let index = (account_id as usize) % SHARD_COUNT;
        lock(&self.shards[index])
    }

    /// The caller's lease state; `None` when the book is full (the caller is decided per request).
    fn slot(&self, charge: &Charge<'_>, terms: LeaseTerms) -> Option<Arc<Slot>> {
        let mut shard = self.shard(charge.account.id);
        if let Some(slot) = shard.get(&charge.account.id) {
            return Some(slot.clone());
        }
        if shard.len() >= LEASE_CALLERS_MAX / SHARD_COUNT {
            return None;
        }
        let holder = Holder {
            account_id: charge.account.id,
            plan_id: charge.plan_id,
            capacity: charge.account.capacity.get(),
            window_seconds: charge.account.window_seconds.get(),
            terms,
        };
        let slot = Slot::new(holder);
        shard.insert(charge.account.id, slot.clone());
        Some(slot)
    }

    /// Gives a refunded request's units back to the lease that admitted it, if that lease is
    /// still open on this instance: they may admit another request before its time is over, and
    /// its settlement holds only what stayed used. `false` once it was settled (the settlement
    /// holds them until its window ends, as a per-request hold that expired would).
    pub(super) fn give_back(&self, account_id: u128, leased: LeaseReceipt) -> bool {
        let Some(slot) = self.shard(account_id).get(&account_id).cloned() else {
            return false;
        };
        let mut caller = slot.lock();
        match &mut caller.lease {
            // A receipt is a library user's to keep, and could be made up: one that gives back
            // more than the lease admitted is refused, never believed (nor a panic).
            Some(lease)
                if lease.transfer_id == leased.lease_id
                    && lease.units_used >= leased.units
                    && lease.requests > 0 =>
            {
                lease.units_used -= leased.units;
                lease.requests -= 1;
                true
            }
            _ => false,
        }
    }

    pub(super) fn drain_counts(&self) {
        self.metrics.admitted.drain();
    }

    fn count_wait(&self, plan_id: PlanId) {
        if let Some(counter) = self.metrics.waits.get(plan_id.index()) {
            counter.increment(1);
        }
    }

    pub(super) fn count_transfers(&self, plan_id: PlanId, transfers: u64) {
        if let Some(counter) = self.metrics.transfers.get(plan_id.index()) {
            counter.increment(transfers);
        }
    }

    /// Takes out the leases whose time is over, and the leases
    /// handed over by a renewal ([`CallerLease::handed_over`]), at most a batch; callers idle
    /// for two sweeps (and with nothing handed over) are forgotten. With `sent_before`, every
    /// lease sent before it too, renewing or not.
    ///
    /// A lease whose settlement waits to be sent again stays, unless `retry_now` (a pass that
    /// must settle every lease: the first of a clean shutdown's, or of an operator's act).
    fn due(
        &self,
        now: Instant,
        (sent_before, retry_now): (Option<Instant>, bool),
    ) -> Vec<(Arc<Slot>, Holder, Lease)> {
        let mut due = Vec::new();
        for shard in self.shards.iter() {
            let mut shard = lock(shard);
            shard.retain(|_, slot| {
                let mut caller = slot.lock();
                if due.len() < SETTLE_BATCH_MAX {
                    // One that expired meanwhile is gone from the ledger: nothing to send. One
                    // whose settlement is waiting to be sent again stays.
                    for lease in std::mem::take(&mut caller.handed_over) {
                        if !retry_now && lease.retry_not_before.is_some_and(|at| now < at) {
                            caller.handed_over.push(lease);
                        } else if now < lease.local_expires_at {
                            due.push((slot.clone(), caller.holder, lease));
                        }
                    }
                }
                let Some(cutoff) = sent_before else {
                    // Renewing: a lease whose time is over goes all the same (a renewal held
                    // unrun, or at a slow ledger, kept its unused units held past L; `renew`
                    // finds no lease to replace then); the caller is not forgotten.
                    let kept = self.take_if_due(&mut caller, slot, (now, None), &mut due);
                    return kept || caller.renewing;
                };
                // Renewing: the current lease goes now, and the next when it comes, if sent
                // before the cutoff too.
                if caller.renewing {
                    let retire = caller.retire_renewed_before.max(Some(cutoff));
                    caller.retire_renewed_before = retire;
                }
                self.take_if_due(&mut caller, slot, (now, Some(cutoff)), &mut due)
            });
        }
        due
    }

    /// [`LeaseBook::due`] for one caller: takes its lease into `due` if its time is over (or
    /// it was sent before the cutoff). `false` when the caller can be forgotten.
    fn take_if_due(
        &self,
        caller: &mut CallerLease,
        slot: &Arc<Slot>,
        (now, sent_before): (Instant, Option<Instant>),
        due: &mut Vec<(Arc<Slot>, Holder, Lease)>,
    ) -> bool {
        let over = |lease: &Lease| {
            now >= lease.admit_until || sent_before.is_some_and(|cutoff| lease.sent_at < cutoff)
        };
        match caller.lease {
            Some(lease) if over(&lease) && due.len() < SETTLE_BATCH_MAX => {
                caller.lease = None;
                due.push((slot.clone(), caller.holder, lease));
                true
            }
            Some(ref mut lease) => {
                // Past the batch, a lease sent before an operator's act admits no more: the
                // pass may end at its deadline (a slow ledger) before it comes to this one,
                // which went on admitting a blocked caller for up to L. A sweep settles it.
                if sent_before.is_some_and(|cutoff| lease.sent_at < cutoff) {
                    lease.admit_until = lease.admit_until.min(now.max(lease.sent_at));
                }
                true
            }
            None => {
                // Saturating: a slot kept (a closed account's word, a settlement handed over
                // and failing) sees a sweep every 100 ms, past a `u8` in 26 s.
                caller.idle_sweeps = caller.idle_sweeps.saturating_add(1);
                // Only the book holds it (checked under the shard lock, where `slot` clones
                // it): no request is about to use a forgotten caller.
                // A closed account's word is kept for the caller's next request, a while.
                let closed = caller
                    .closed_at
                    .is_some_and(|at| now < at + CLOSED_WORD_KEPT);
                caller.idle_sweeps < 2
                    || Arc::strong_count(slot) > 1
                    || !caller.handed_over.is_empty()
                    || closed
            }
        }
    }
}

/// A renewal in progress: if its future is dropped before the renewal ends, the drop ends it, so
/// the caller's other requests do not wait for it forever. (A lease taken meanwhile is voided by
/// the ledger call when its answer finds nobody waiting; a retired lease expires on its own.)
struct Renewal<'a> {
    slot: &'a Slot,
    ending: bool,
}

impl Drop for Renewal<'_> {
    fn drop(&mut self) {
        if self.ending {
            let mut caller = self.slot.lock();
            self.slot.renewal_ended(&mut caller);
        }
    }
}

/// A renewal ahead of need that a lease admission started ([`Limiter::from_memory`],
/// [`Limiter::check_with`]): whoever holds it runs it with
/// [`Limiter::renew_lease_ahead`], so that the admitted request is answered without waiting for
/// the ledger. Dropped unrun, it ends the renewal, so another request takes the next lease.
#[must_use = "a renewal ahead ends unrun when dropped"]
pub struct RenewalAhead {
    /// `None` once handed to [`Limiter::renew`], whose own guard then ends it.
    slot: Option<Arc<Slot>>,
    cost: u64,
}

impl Drop for RenewalAhead {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            let mut caller = slot.lock();
            slot.renewal_ended(&mut caller);
        }
    }
}

/// What a renewal came to.
enum Renewed {
    Leased,
    /// No lease now (credit too low, or a new caller to provision): decide per request.
    NoLease,
    /// The ledger refused the lease on a closed account (a block, or a move away).
    Closed,
}

/// What taking a lease came to.
enum Taken {
    Lease(Lease),
    NoLease,
    Closed,
}

/// What waiting for another request's renewal came to.
enum Waited {
    /// Ended (whatever it brought): look again.
    Renewed,
    PerRequest,
    /// The renewal at the ledger outlasted the deadline: the failure policy's answer.
    Failed(Decided),
}

/// What one look at the caller's lease came to.
enum Look<'a> {
    Admitted(Decided, LeaseReceipt),
    /// Admitted, and this request takes the next lease ahead of need.
    AdmittedRenewing(Decided, LeaseReceipt),
    /// No room: this request renews (the current lease, if any, is retired first).
    Renew(Option<Lease>),
    /// Another request renews: wait for it (`true`: its ledger calls have started).
    Wait(Pin<Box<Notified<'a>>>, bool),
    /// No lease, and no demand for one yet: decided per request.
    PerRequest,
    /// A renewal found the account closed ([`CallerLease::closed_at`]).
    Closed,
}

/// `view` with every lease ending when its instance settles it (L after it was placed, plus a
/// sweep), not at its timeout (window + L): what a caller refused because of other instances'
/// leases is told to wait (`Retry-After`, `RateLimit`'s `t`), at most L + [`SETTLE_TICK`] for
/// their unused units. Only earlier than the ledger's release, so the local view that learns from
/// it knows fewer holds, never more: it refuses less, never wrongly. (The settlement holds the
/// used units on; a lease whose instance died holds them until its timeout.)
///
/// A lease listed just after its settlement was due ([`SETTLE_LATE_GRACE`]) counts for one more
/// sweep; one listed later (`now_wall`: its instance died, or its settlement is being sent
/// again) for another L and a sweep from now. Shortened to its due time,
/// already past, it was forgotten at once: each of the caller's requests then tried a lease, a
/// hold and a listing, each refused, and was told `Retry-After: 1`, for the rest of the window.
pub(super) fn settling_soon(
    mut view: crate::ledger::AccountView,
    terms: LeaseTerms,
    now_wall: SystemTime,
) -> crate::ledger::AccountView {
    let settled_within = Duration::from_secs(terms.seconds.get().into()) + SETTLE_TICK;
    for hold in &mut view.holds {
        if let Some(leased_at) = hold.leased_at {
            let due = leased_at + settled_within;
            let due = if due > now_wall {
                due
            } else if now_wall < due + SETTLE_LATE_GRACE {
                // Just due: its settlement is on its way, a sweep and a round trip.
                now_wall + SETTLE_TICK
            } else {
                now_wall + settled_within
            };
            hold.expires_at = hold.expires_at.min(due);
        }
    }
    view.holds.sort_by_key(|hold| hold.expires_at);
    view
}

/// [`settling_soon`] of what a read of an account answered, when the account is a lease plan's
/// (`terms`); any other answer as it is. For every refusal that reads the account: the plan's
/// own, and a plan's beside route limits.
pub(super) fn listing_settling_soon(
    view: Result<Option<crate::ledger::AccountView>, LedgerError>,
    terms: Option<LeaseTerms>,
    now_wall: SystemTime,
) -> Result<Option<crate::ledger::AccountView>, LedgerError> {
    match (view, terms) {
        (Ok(Some(view)), Some(terms)) => Ok(Some(settling_soon(view, terms, now_wall))),
        (view, _) => view,
    }
}

impl<S: Store, C: Clock> Limiter<S, C> {
    /// A caller's first request takes a lease from now on, its demand unseen (tests of what a
    /// lease does once taken start from one).
    #[cfg(test)]
    pub(super) fn leasing_at_first_request(mut self) -> Self {
        self.leases.lease_at_first_request = true;
        self
    }

    /// A decision on a lease plan: from the caller's lease in memory when it has room (the request
    /// that finds it half spent also gets the renewal of the next one, to run); else after a
    /// renewal, its own or another request's (one not started yet is waited for half the time
    /// left); per request (exact, as without leases) when no lease can be had. Everything by
    /// `at.deadline`.
    pub(super) async fn decide_leased(
        &self,
        charge: &Charge<'_>,
        terms: LeaseTerms,
        at: Timing,
    ) -> Result<Reached, u64> {
        let slot = match self.leases.slot(charge, terms) {
            Some(slot) if charge.cost <= terms.units_max.get() => slot,
            _ => return self.decide_per_request_counted(charge, at).await,
        };
        let deadline = at.deadline;
        for _ in 0..LEASE_ATTEMPTS_MAX {
            match self.look(&slot, charge.cost) {
                Look::Admitted(decided, leased) => return Ok((decided, Some(leased), None)),
                // The renewal ahead of need is the caller's to run, after its answer.
                Look::AdmittedRenewing(decided, leased) => {
                    let renewal = RenewalAhead {
                        slot: Some(slot.clone()),
                        cost: charge.cost,
                    };
                    return Ok((decided, Some(leased), Some(renewal)));
                }
                Look::PerRequest => break,
                // Unblocked since: per request.
                Look::Closed => match self.refused_closed_leased(charge, deadline, false).await {
                    Some(refused) => return refused,
                    None => break,
                },
                // Renewals are boxed: inline, their kilobytes of state would make every lease
                // admission's future (and its copies) that large. (A decision per request boxes
                // its own ledger path.)
                Look::Renew(retired) => {
                    match Box::pin(self.renew(&slot, charge.cost, retired, deadline)).await {
                        Ok(Renewed::Leased) => {}
                        Ok(Renewed::NoLease) => break,
                        // The ledger's word, whatever the policy: a hold per request that then
                        // failed would have gone to the policy, which admits under fail-open.
                        Ok(Renewed::Closed) => {
                            let refused = self.refused_closed_leased(charge, deadline, true);
                            return refused.await.expect("refused whatever the account reads");
                        }
                        Err(error) => return Ok((self.failed(error, charge), None, None)),
                    }
                }
                Look::Wait(renewed, running) => {
                    match self
                        .wait_for_renewal(charge, (renewed, running), deadline)
                        .await
                    {
                        Waited::Renewed => {}
                        Waited::PerRequest => break,
                        Waited::Failed(failed) => return Ok((failed, None, None)),
                    }
                }
            }
        }
        self.decide_per_request_counted(charge, at).await
    }

    /// Waits for another request's renewal. One at the ledger (`running`) is waited for until
    /// the deadline: it brings the lease sooner than a hold of this request's own would land.
    /// One not started (a renewal ahead its request holds unrun: a library user's, run after a
    /// slow handler) half the time left at most, then decided per request with the rest: every
    /// request waiting on it went to the failure policy.
    async fn wait_for_renewal(
        &self,
        charge: &Charge<'_>,
        (renewed, running): (Pin<Box<Notified<'_>>>, bool),
        deadline: Instant,
    ) -> Waited {
        self.leases.count_wait(charge.plan_id);
        let now = self.clock.now();
        let waited_until = match running {
            true => deadline,
            false => now + deadline.saturating_duration_since(now) / 2,
        };
        let timed_out = tokio::time::timeout_at(waited_until.into(), renewed)
            .await
            .is_err();
        match (timed_out, running) {
            (false, _) => Waited::Renewed,
            (true, false) => Waited::PerRequest,
            (true, true) => {
                let operation = crate::ledger::metrics::Operation::CreateTransfers;
                Waited::Failed(self.failed(LedgerError::Timeout { operation }, charge))
            }
        }
    }

    /// [`Limiter::decide_leased`]'s first look, without waiting: admits `cost` from the caller's
    /// lease when it has room, and starts the renewal when that makes it due (the caller runs it).
    /// `None` (nothing changed) when the lease cannot admit it.
    pub(super) fn admit_from_lease_now(
        &self,
        charge: &Charge<'_>,
        terms: LeaseTerms,
    ) -> Option<(Decided, LeaseReceipt, Option<RenewalAhead>)> {
        if charge.cost > terms.units_max.get() {
            return None;
        }
        let slot = self.leases.slot(charge, terms)?;
        let mut caller = slot.lock();
        // Read under the lock: a wait for it is not time the lease's `admit_until` allowed.
        let clocks = (self.clock.now(), self.clock.wall());
        let (decided, leased, renewing) = self.admit_locked(&mut caller, charge.cost, clocks)?;
        drop(caller);
        let renewal = renewing.then(|| RenewalAhead {
            slot: Some(slot),
            cost: charge.cost,
        });
        Some((decided, leased, renewal))
    }

    /// Admits `cost` from the caller's lease, under its lock: `None` when the lease cannot, else
    /// the decision, the receipt, and whether this admission started the renewal ahead of need
    /// (the lease is now half spent, and nobody was renewing).
    fn admit_locked(
        &self,
        caller: &mut CallerLease,
        cost: u64,
        (now, wall): (Instant, SystemTime),
    ) -> Option<(Decided, LeaseReceipt, bool)> {
        if !caller.admit(cost, (now, wall)) {
            return None;
        }
        let (decided, leased) = self.admitted_from_lease(caller, cost, now);
        let renewing = caller.renew_ahead(now);
        if renewing {
            caller.start_renewal(now);
        }
        Some((decided, leased, renewing))
    }

    /// Runs a renewal ahead of need that an admission started ([`RenewalAhead`]), by
    /// `ledger_timeout` from now. Its outcome is the next lease or none; either way the caller's
    /// next requests go on (a failed renewal is retried by the next request that finds the lease
    /// half spent).
    pub async fn renew_lease_ahead(&self, renewal: RenewalAhead) {
        let deadline = self.deadline();
        self.renew_lease_ahead_by(renewal, deadline).await;
    }

    /// [`Limiter::renew_lease_ahead`] by `deadline` ([`Limiter::check`]'s own, which runs it).
    pub(super) async fn renew_lease_ahead_by(&self, mut renewal: RenewalAhead, deadline: Instant) {
        let slot = renewal.slot.take().expect("a renewal ahead is run once");
        // `renew` ends the renewal from its first poll on, which is this one: no gap.
        if let Err(error) = Box::pin(self.renew(&slot, renewal.cost, None, deadline)).await {
            tracing::debug!(%error, "could not renew a lease ahead; the next request will");
        }
    }

    /// One look at the caller's lease, under its lock (never held across a ledger call).
    fn look<'a>(&self, slot: &'a Slot, cost: u64) -> Look<'a> {
        let mut caller = slot.lock();
        if caller.closed_at.take().is_some() {
            return Look::Closed;
        }
        // Read under the lock: a wait for it is not time the lease's `admit_until` allowed.
        let now = self.clock.now();
        match self.admit_locked(&mut caller, cost, (now, self.clock.wall())) {
            Some((decided, leased, true)) => return Look::AdmittedRenewing(decided, leased),
            Some((decided, leased, false)) => return Look::Admitted(decided, leased),
            None => {}
        }
        if caller.renewing {
            // Registered under the lock that ends a renewal: its end cannot be missed.
            let mut renewed = Box::pin(slot.renewed.notified());
            renewed.as_mut().enable();
            return Look::Wait(renewed, caller.renewal_running);
        }
        if caller.lease.is_none() && !caller.demand(now) && !self.leases.lease_at_first_request() {
            return Look::PerRequest;
        }
        caller.start_renewal(now);
        Look::Renew(caller.lease.take())
    }

    /// The ledger refused a lease on `charge`'s closed account (`just_refused`: for this
    /// request; else a renewal ahead did, [`CallerLease::closed_at`]): refused as a hold per request
    /// is ([`Limiter::refused_closed`]); `None` if the account reads open now, and `just_refused`
    /// is false (unblocked since). Why not per request after it: a hold that then failed went to
    /// the failure policy, which admits under fail-open a caller the ledger has said is blocked,
    /// and the view does not know yet.
    async fn refused_closed_leased(
        &self,
        charge: &Charge<'_>,
        deadline: Instant,
        just_refused: bool,
    ) -> Option<Result<Reached, u64>> {
        let read = self.local.generation(charge.account.id);
        let refused = self.refused_if_closed(charge, (deadline, read), just_refused);
        match Box::pin(refused).await? {
            NotAdmitted::Refused(outcome, local) => Some(Ok(((outcome, local, None), None, None))),
            NotAdmitted::Moved(tag) => Some(Err(tag)),
        }
    }

    fn failed(&self, error: LedgerError, charge: &Charge<'_>) -> Decided {
        let (outcome, local) = self.fail(error, charge);
        (outcome, local, None)
    }

    /// Per request, on a lease plan: counts the hold (for the transfers-per-request metric).
    async fn decide_per_request_counted(
        &self,
        charge: &Charge<'_>,
        at: Timing,
    ) -> Result<Reached, u64> {
        let decided = self.decide_per_request(charge, at).await?;
        if decided.2.is_some() {
            self.leases.count_transfers(charge.plan_id, 1);
        }
        Ok((decided, None, None))
    }

    /// The renewal this request started: settles `retired` (a lease that can no longer admit)
    /// first, so its unused units count again, then takes the next lease; a lease it replaces
    /// ahead of need is settled after. Always ends the renewal.
    async fn renew(
        &self,
        slot: &Slot,
        cost: u64,
        retired: Option<Lease>,
        deadline: Instant,
    ) -> Result<Renewed, LedgerError> {
        // Ends the renewal if this future is dropped (a client went away) before it does.
        let mut renewal = Renewal { slot, ending: true };
        let holder = {
            let mut caller = slot.lock();
            caller.renewal_running = true;
            caller.holder
        };
        if let Some(lease) = retired {
            self.settle_or_hand_over(slot, &holder, lease, deadline)
                .await;
        }
        let taken = self.take(slot, &holder, cost, deadline).await;
        let (renewed, replaced) = {
            let mut caller = slot.lock();
            let (renewed, replaced) = match taken {
                Ok(Taken::Lease(lease)) => {
                    let stale = caller
                        .retire_renewed_before
                        .is_some_and(|cutoff| lease.sent_at < cutoff);
                    let replaced = match stale {
                        true => Some(lease),
                        false => caller.lease.replace(lease),
                    };
                    (Ok(Renewed::Leased), replaced)
                }
                Ok(Taken::NoLease) => (Ok(Renewed::NoLease), None),
                Ok(Taken::Closed) => (Ok(Renewed::Closed), None),
                Err(error) => (Err(error), None),
            };
            slot.renewal_ended(&mut caller);
            renewal.ending = false;
            (renewed, replaced)
        };
        // No admission from `replaced` after the lock above: its settlement is sent after its last.
        if let Some(lease) = replaced {
            self.settle_or_hand_over(slot, &holder, lease, deadline)
                .await;
        }
        renewed
    }

    /// Settles `lease` by `deadline` if any of it is left; else hands it to the sweeper
    /// ([`CallerLease::handed_over`]). Why: a call with no time left is not sent, and a renewal
    /// run within its request's deadline (`check`) can spend it on the lease it takes. The lease
    /// it replaced then went unsettled, its unused units held from every instance for window + L.
    async fn settle_or_hand_over(
        &self,
        slot: &Slot,
        holder: &Holder,
        lease: Lease,
        deadline: Instant,
    ) {
        if self.clock.now() < deadline {
            self.settle_else_hand_over(slot, holder, lease, deadline)
                .await;
            return;
        }
        self.hand_over(slot, holder, lease);
    }

    /// Settles `lease` by `deadline`, or hands it to the sweeper if it can be sent again;
    /// `true` when the settlement ended the lease.
    async fn settle_else_hand_over(
        &self,
        slot: &Slot,
        holder: &Holder,
        lease: Lease,
        deadline: Instant,
    ) -> bool {
        match self.settle(holder, lease, deadline).await {
            Some(unsettled) => {
                self.hand_over(slot, holder, unsettled);
                false
            }
            None => true,
        }
    }

    /// Leaves `lease` to the sweeper's next tick ([`CallerLease::handed_over`]), if the caller
    /// has room there.
    fn hand_over(&self, slot: &Slot, holder: &Holder, lease: Lease) {
        let mut caller = slot.lock();
        if caller.handed_over.len() < HANDED_OVER_MAX {
            caller.handed_over.push(lease);
            return;
        }
        // Left to expire, which holds every unit it admitted; the view must not count it whole.
        drop(caller);
        self.local.forget(holder.account_id);
        tracing::debug!("a lease's settlement could not be sent again; it expires window + L after it was placed");
    }

    /// Takes a lease for `holder`: [`Taken::NoLease`] when the caller should be decided per
    /// request, [`Taken::Closed`] when the ledger refused it on a closed account.
    async fn take(
        &self,
        slot: &Slot,
        holder: &Holder,
        cost: u64,
        deadline: Instant,
    ) -> Result<Taken, LedgerError> {
        let (sent_at, sent_wall) = (self.clock.now(), self.clock.wall());
        let id = holder.account_id;
        let Some(units) = self.lease_units(slot, holder, cost, sent_at) else {
            // No room, as the view knows: else each later admission renews ahead for nothing.
            slot.lock().refused = true;
            return Ok(Taken::NoLease);
        };
        let lease_seconds = holder.terms.seconds.get();
        let timeout_seconds = holder.window_seconds.saturating_add(lease_seconds);
        let placed = self
            .place_lease(holder, units, timeout_seconds, deadline)
            .await;
        if let Err(LedgerError::Overloaded { .. }) = placed {
            // The bound is full: each admission from this lease's second half would send one
            // more, refused at once. The next lease is taken when this one runs out.
            slot.lock().refused = true;
        }
        let reply = placed?;
        let (roundtrip, transfer_id) = match reply {
            HoldReply::Held {
                roundtrip,
                transfer_id,
            } => (roundtrip, transfer_id),
            HoldReply::ExceedsCredits => {
                let mut caller = slot.lock();
                caller.next_units = (units / 2).max(1);
                caller.refused = true;
                return Ok(Taken::NoLease);
            }
            HoldReply::Blocked => return Ok(self.taken_closed(slot, holder, deadline).await),
            // Not found after provisioning: decided per request.
            HoldReply::AccountNotFound => return Ok(Taken::NoLease),
        };
        let timeout = Duration::from_secs(timeout_seconds.into());
        self.local.record_hold(
            id,
            holder.capacity,
            units,
            roundtrip,
            timeout,
            self.clock.now(),
        );
        {
            let mut caller = slot.lock();
            caller.idle_sweeps = 0;
            caller.refused = false;
        }
        Ok(Taken::Lease(Lease {
            transfer_id,
            units,
            units_used: 0,
            requests: 0,
            sent_at,
            admit_until: sent_at + Duration::from_secs(lease_seconds.into()),
            admit_until_wall: sent_wall + Duration::from_secs(lease_seconds.into()),
            local_expires_at: roundtrip.answered_at + timeout + self.settings.expiry_margin,
            unknown_tries: 0,
            retry_not_before: None,
            settling_since: None,
        }))
    }

    /// The units of the lease `holder` takes next, for a request of `cost`: `None` when it should
    /// be decided per request.
    fn lease_units(&self, slot: &Slot, holder: &Holder, cost: u64, now: Instant) -> Option<u64> {
        let id = holder.account_id;
        // What the local view refuses (a block it read, or no credit free) is the per-request
        // path's to refuse from memory: a lease tried first was a ledger write per request of a
        // blocked caller, each refused.
        if self.local.check(id, cost, now).is_some() {
            return None;
        }
        // The local view's remaining credit is an upper bound of the ledger's: a lease larger than
        // half of it would fail, or starve other instances.
        let remaining = self.local.quota(id, holder.capacity, now).remaining;
        if remaining < cost {
            return None;
        }
        let units = slot.lock().next_units.min(remaining / 2).max(cost);
        assert!(units >= cost && units <= holder.terms.units_max.get());
        Some(units)
    }

    /// The ledger refused a lease on `holder`'s closed account (a block, a move): its next
    /// request hears of it ([`CallerLease::closed_at`]), and so does the failure policy (the next
    /// request may find the ledger down after that word is gone, an idle caller forgotten). The
    /// current lease admits no more (it would for up to L); its settlement can only void it when
    /// it admitted nothing, else it holds on to its timeout (`Settled::AccountClosed`).
    async fn taken_closed(&self, slot: &Slot, holder: &Holder, deadline: Instant) -> Taken {
        // The word and the lease's end under one lock: nothing admits from it after.
        let current = {
            let mut caller = slot.lock();
            caller.closed_at = Some(self.clock.now());
            caller.lease.take()
        };
        if let Some(lease) = current {
            self.settle_or_hand_over(slot, holder, lease, deadline)
                .await;
        }
        self.read_closed(holder, deadline).await;
        Taken::Closed
    }

    /// Reads `holder`'s account, which the ledger just called closed, into the local view: its
    /// block, until its end, answers for the failure policy. (Not read by `deadline`, nothing:
    /// a guess would refuse a caller that moved away, where it should follow the move.)
    async fn read_closed(&self, holder: &Holder, deadline: Instant) {
        let id = holder.account_id;
        let read = self.local.generation(id);
        let hold_seconds_max = self.plans.hold_seconds_max();
        let view = self
            .store
            .account_view(id, hold_seconds_max.get(), deadline)
            .await;
        let wall = self.clock.wall();
        let view = listing_settling_soon(view, Some(holder.terms), wall);
        if let Ok(Some(view)) = view {
            let listing = Listing { view: &view, read };
            let hold_max = self.hold_max();
            self.local
                .replace(id, listing, 0, hold_max, self.clock.now(), wall);
        }
    }

    /// Places a lease of `units` for `holder`, provisioning a new caller first if need be.
    async fn place_lease(
        &self,
        holder: &Holder,
        units: u64,
        timeout_seconds: u32,
        deadline: Instant,
    ) -> Result<HoldReply, LedgerError> {
        let id = holder.account_id;
        let mut reply = self
            .store
            .take_lease(id, units, timeout_seconds, deadline)
            .await?;
        self.leases.count_transfers(holder.plan_id, 1);
        if reply == HoldReply::AccountNotFound {
            // A new caller: provision it here (idempotent), once, so the requests waiting for
            // this renewal get a lease rather than each provisioning per request.
            self.store.provision(&holder.account(), deadline).await?;
            reply = self
                .store
                .take_lease(id, units, timeout_seconds, deadline)
                .await?;
            self.leases.count_transfers(holder.plan_id, 1);
        }
        Ok(reply)
    }

    /// Settles `lease`, which no longer admits, by `deadline`. `Some(lease)` when it did not end
    /// the lease and it can be sent again (a lease left to expire instead holds every unit it
    /// admitted, and its unused ones, for window + L: half a caller's capacity for a minute,
    /// from every settlement a ledger blip or a failover caught in flight):
    /// - never sent (refused a place under the in-flight bound, or no time left): the lease is
    ///   untouched, and still counted whole in the ledger as in the local view;
    /// - sent, its outcome unknown (a timeout, a lost answer): see
    ///   [`Limiter::unknown_settlement`].
    async fn settle(&self, holder: &Holder, lease: Lease, deadline: Instant) -> Option<Lease> {
        assert!(lease.units_used <= lease.units);
        let now = self.clock.now();
        // No time left (a sweep's late round): the ledger's client would send nothing and
        // answer `Timeout`, read as an unknown outcome: the view then counted the lease settled
        // while the ledger held it whole, and its retry waited a ledger timeout. Untouched, it
        // goes with the next sweep.
        if now >= deadline {
            return Some(lease);
        }
        let lease = Lease {
            settling_since: lease.settling_since.or(Some(now)),
            ..lease
        };
        let settlement = holder.settlement(&lease, now);
        let transfers = if lease.units_used == 0 { 1 } else { 2 };
        // Dropped before the answer (a renewing request's client went away): the settlement
        // may land all the same (the call runs in a task of its own) and nothing below runs, so
        // the view forgets the caller, as on an error, rather than count the whole lease on.
        let unanswered = super::ForgetIfDropped::new(&self.local, [holder.account_id]);
        let result = self.store.settle_lease(settlement, deadline).await;
        unanswered.disarm();
        if !matches!(result, Err(LedgerError::Overloaded { .. })) {
            self.leases.count_transfers(holder.plan_id, transfers);
        }
        match result {
            Ok(Settled::Done) if !lease.counted_settled() => self.count_settled(holder, &lease),
            Ok(Settled::Done) => {}
            // Expired: its units are out of every window that needed them; the local view forgets
            // it at its recorded expiry.
            Ok(Settled::LeaseGone) => {}
            // Closed by an operator: the lease holds on, in the ledger as in the local view,
            // until its timeout (window + L), which covers every unit it admitted.
            Ok(Settled::AccountClosed) => {
                tracing::debug!("a lease of a closed account is left to expire");
            }
            // Never sent: the sweeper sends it again (else its unused units held window + L).
            Err(LedgerError::Overloaded { .. }) => return Some(lease),
            Err(error) => return self.unknown_settlement(holder, lease, &error),
        }
        None
    }

    /// A settlement whose outcome is unknown: the lease to send again later (until it expires:
    /// a whole-cluster outage outlasts any count of tries), unless the ledger's answer was one
    /// it should never give (sent again, it would give it again); such a lease is left to
    /// expire, which holds every unit it admitted. Sent again, it is safe either way: its void
    /// has a fresh id, so a settlement that landed answers the retry
    /// `pending_transfer_already_voided` (the lease is gone), and its linked hold is not made
    /// twice. Meanwhile the local view counts it settled (its lower bound), and it waits a
    /// ledger timeout, doubling with each try, before it is sent again.
    fn unknown_settlement(
        &self,
        holder: &Holder,
        lease: Lease,
        error: &LedgerError,
    ) -> Option<Lease> {
        // Landed or not, unknown: the ledger holds the whole lease, or the units used. The view
        // counts the lesser, as if settled: counting the whole lease on could refuse from memory
        // what the ledger admits; forgetting the caller, under the open policy with the ledger
        // down, admitted a caller it knew was spent.
        if !lease.counted_settled() {
            self.count_settled(holder, &lease);
        }
        if matches!(error, LedgerError::Unexpected { .. }) {
            tracing::debug!(%error, "could not settle a lease; it expires window + L after it was placed");
            return None;
        }
        tracing::debug!(%error, "could not settle a lease; it is sent again");
        // A ledger timeout, doubled each try, at most UNKNOWN_RETRY_WAIT_MAX.
        let tries = lease.unknown_tries.saturating_add(1).min(8);
        let wait = self.settings.ledger_timeout * (1 << (tries - 1));
        Some(Lease {
            unknown_tries: tries,
            retry_not_before: Some(self.clock.now() + wait.min(UNKNOWN_RETRY_WAIT_MAX)),
            ..lease
        })
    }

    /// What the local view knows of a settled lease: its units released, and the units it
    /// admitted held for a window from its settlement's first try (the settlement's hold ends
    /// no sooner, [`Holder::settlement`]). From now, a settlement sent again seconds after its
    /// first try was counted past the ledger's hold, and refused from memory what the ledger
    /// admits.
    fn count_settled(&self, holder: &Holder, lease: &Lease) {
        let id = holder.account_id;
        self.local.release(id, lease.units, lease.local_expires_at);
        if lease.units_used > 0 {
            let since = lease
                .settling_since
                .expect("counted once its settlement is tried");
            let now = self.clock.now();
            let window = Duration::from_secs(holder.window_seconds.into());
            let left = window.saturating_sub(now.saturating_duration_since(since));
            let used = lease.units_used;
            self.local
                .record_settled_hold(id, holder.capacity, used, left, now);
        }
    }

    /// The decision and receipt for `cost` units just admitted from the caller's lease.
    fn admitted_from_lease(
        &self,
        caller: &CallerLease,
        cost: u64,
        now: Instant,
    ) -> (Decided, LeaseReceipt) {
        let holder = &caller.holder;
        let lease = caller.lease.expect("it admitted");
        self.leases.metrics.admitted.add(holder.plan_id.index(), 1);
        let local = self.local.quota(holder.account_id, holder.capacity, now);
        let quota = LocalQuota {
            // The lease counts as held in the local view; its unused units are still this
            // caller's to spend here.
            remaining: local
                .remaining
                .saturating_add(lease.units - lease.units_used)
                .min(holder.capacity),
            reset_after: local.reset_after,
        };
        let leased = LeaseReceipt {
            lease_id: lease.transfer_id,
            units: cost,
        };
        ((Outcome::Admitted, quota, None), leased)
    }

    /// Settles every lease whose time L is over: the sweeper calls it every [`SETTLE_TICK`], so
    /// unused leased units return about L after the lease was taken even when the caller
    /// stopped sending. Returns how many it settled.
    ///
    /// Batch after batch while they come back full, each with a deadline of its own: one batch
    /// a tick, taken from the shards in order, left the callers of the last shards waiting for
    /// as long as the first ones had a batch due.
    ///
    /// A batch that did not end every lease ends the sweep: the in-flight bound is full, or
    /// the ledger is in trouble, and the next batch would be those very leases again (handed
    /// over leases come first): refused at once, pass after pass with no await that waits, or
    /// each pass a deadline long, until the loop's bound. The next tick sends them again.
    pub async fn settle_due_leases(&self) -> usize {
        let mut settled = 0;
        for _ in 0..=2 * LEASE_CALLERS_MAX / SETTLE_BATCH_MAX {
            let swept = self.settle_leases((None, false), None).await;
            settled += swept.sent;
            if swept.due < SETTLE_BATCH_MAX || swept.sent < swept.due {
                break;
            }
        }
        settled
    }

    /// Settles every lease now, whatever its time (a clean shutdown, after the server stopped
    /// taking requests): unused leased units return at once rather than window + L later.
    ///
    /// One deadline for the whole pass, at least a second: with the ledger down,
    /// a deadline per batch made a shutdown wait up to 65 of them. A lease not settled by then
    /// is out of memory all the same, and the ledger releases it at its timeout.
    pub async fn settle_all_leases(&self) -> usize {
        // Every lease sent during the pass too (a renewal in flight): none is sent after it.
        self.settle_leases_sent_before(None).await
    }

    /// Settles every lease sent before `cutoff` (an operator acted: a lease stamped before
    /// the act admits from memory what the act changed; `None`: all, up to the pass's end),
    /// with one deadline as [`Limiter::settle_all_leases`]. Those sent since are stamped after
    /// the act, so the ledger judged them by it: without the cutoff, every lease an instance
    /// held went at each operator action anywhere (a top-up included), renewals in flight too,
    /// and hot callers fell back to a ledger call per request for a second.
    pub async fn settle_leases_sent_before(&self, cutoff: Option<Instant>) -> usize {
        let deadline = self.clock.now() + self.settings.ledger_timeout.max(SETTLE_ALL_TIME_MIN);
        let cutoff = cutoff.unwrap_or(deadline);
        let mut settled = 0;
        // A caller can have two leases to settle: its own, and one a renewal handed over.
        for pass in 0..=2 * LEASE_CALLERS_MAX / SETTLE_BATCH_MAX {
            // The first pass sends those waiting to be sent again too (a clean shutdown left
            // them held for window + L); later ones leave them their wait.
            let due = (Some(cutoff), pass == 0);
            let swept = self.settle_leases(due, Some(deadline)).await;
            settled += swept.sent;
            if swept.due == 0 || self.clock.now() >= deadline {
                break;
            }
            if swept.sent < swept.due {
                // The bound is full: its places come back as calls end (or time out).
                tokio::time::sleep(SETTLE_RETRY_WAIT).await;
            }
        }
        settled
    }

    /// Settles the leases due, [`SETTLE_CONCURRENCY_MAX`] at a time at most, and at most a
    /// quarter of the ledger's in-flight bound. Why: each settlement is a call under that bound,
    /// and a whole batch (256) at once took its places from the decisions (every place, under
    /// a small `ledger.in_flight_max`: decisions then failed `Overloaded`, and so did the
    /// settlements beyond the bound, their unused units held window + L instead of L).
    ///
    /// Each round has a deadline of its own (`ledger.timeout_ms` from its start), unless
    /// `deadline` is given (a clean shutdown's one deadline for the whole pass): rounds one after
    /// another under one deadline left the last ones none when the ledger was slow.
    async fn settle_leases(
        &self,
        due: (Option<Instant>, bool),
        deadline: Option<Instant>,
    ) -> Swept {
        let due = self.leases.due(self.clock.now(), due);
        let at_once = (self.store.in_flight_max() / 4).clamp(1, SETTLE_CONCURRENCY_MAX);
        let mut sent = 0;
        for round in due.chunks(at_once) {
            let deadline = deadline.unwrap_or_else(|| self.deadline());
            let settlements = round.iter().map(|(slot, holder, lease)| {
                self.settle_else_hand_over(slot, holder, *lease, deadline)
            });
            let ended = futures_util::future::join_all(settlements).await;
            sent += ended.iter().filter(|ended| **ended).count();
        }
        Swept {
            due: due.len(),
            sent,
        }
    }
}

/// What one batch of [`Limiter::settle_leases`] came to: leases due, and settlements that
/// ended their lease (the rest were refused a place, or their outcome is unknown, and were
/// handed over to be sent again).
struct Swept {
    due: usize,
    sent: usize,
}

/// How long a clean shutdown's settling waits for a place under a full in-flight bound.
const SETTLE_RETRY_WAIT: Duration = Duration::from_millis(10);

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
