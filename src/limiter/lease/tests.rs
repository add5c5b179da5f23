//! The lease invariant, through the seams: an exact model of the ledger (pending transfers that
//! release exactly at `stamp + timeout`, linked settlement, injected failures) shared by several
//! limiter instances on a manual clock. At every instant — every event and every expiry between
//! events — the units the model holds must be at least the units admitted in the last window.

use std::collections::{HashMap, VecDeque};
use std::num::{NonZeroU32, NonZeroU64};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use proptest::prelude::*;

use super::super::caller::CallerKey;
use super::super::plan::{LeaseTerms, Plan, PlanBook, UnknownKeys};
use super::super::store::{Clock, Store};
use super::super::{
    Decision, DecisionSource, FailurePolicy, FromMemory, Limiter, LimiterSettings, Outcome,
};
use super::RenewalAhead;
use crate::ledger::lease::{Settled, Settlement};
use crate::ledger::metrics::Operation;
use crate::ledger::model::{UserAccount, LEDGER_REQUEST_RATE};
use crate::ledger::{AccountView, Hold, HoldReply, LedgerError, Roundtrip};

const CAPACITY: u64 = 24;
const WINDOW_SECONDS: u32 = 3;
const WINDOW: Duration = Duration::from_secs(WINDOW_SECONDS as u64);
const LEASE_UNITS_MAX: u64 = 12;
const LEASE_SECONDS: u32 = 1;

#[derive(Clone)]
struct TestClock(Arc<Mutex<(Instant, SystemTime)>>);

impl TestClock {
    fn advance_to(&self, to: Instant) {
        let mut now = self.0.lock().unwrap();
        let by = to - now.0;
        now.0 = to;
        now.1 += by;
    }

    /// The wall clock alone moves on, as over a suspended host's sleep (or set forward).
    fn advance_wall(&self, by: Duration) {
        self.0.lock().unwrap().1 += by;
    }

    /// The wall clock alone set back.
    fn set_wall_back(&self, by: Duration) {
        self.0.lock().unwrap().1 -= by;
    }
}

impl Clock for TestClock {
    fn now(&self) -> Instant {
        self.0.lock().unwrap().0
    }

    fn wall(&self) -> SystemTime {
        self.0.lock().unwrap().1
    }
}

/// What the next ledger call does besides its work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// Applied, but the answer never arrives (the caller sees a timeout).
    LostReply,
    /// Never applied (the caller sees a timeout).
    NotApplied,
}

#[derive(Default)]
struct Model {
    /// id → (amount, expires_at, voided)
    pendings: HashMap<u128, (u64, Instant, bool)>,
    next_id: u128,
    faults: VecDeque<Fault>,
    leases: u64,
    /// Holds placed per request (not leases, not settlements).
    holds: u64,
    settlements: u64,
    /// The next lease call never answers.
    hang_next_lease: bool,
    /// The next settlement is applied, and never answered.
    hang_next_settlement: bool,
    /// The next settlement is refused a place under the in-flight bound (never sent).
    overload_next_settlement: bool,
    /// Lease calls from now are refused a place under the in-flight bound (never sent).
    overload_leases: bool,
    /// The next lease call takes this long (on the test clock) before it is applied.
    slow_next_lease: Duration,
    /// The next lease call is applied at once, but answered only when this is sent.
    answer_next_lease_on: Option<tokio::sync::oneshot::Receiver<()>>,
    /// Lease calls made (answered or not).
    lease_calls: u64,
    /// The account is closed by an operator: every new hold and lease is refused so.
    blocked: bool,
    /// Every call yields once before it is applied, so requests decided together interleave at
    /// the ledger as they do in service (the property test's).
    yields: bool,
    /// Holds per request (not leases) are never applied: each times out.
    holds_time_out: bool,
    /// How long a block lasts as the account reads (a minute if `None`).
    block_seconds: Option<u64>,
    /// How long after the ledger stamped it a lease's answer says it arrived: the proof's step
    /// "admit until sent + L", not until answered + L, is tested only when the two differ.
    lease_latency: Duration,
    /// The clock when the run ended ([`run`]).
    ended_at: Option<Instant>,
}

impl Model {
    fn held(&self, at: Instant) -> u64 {
        let live = self.pendings.values().filter(|(_, e, v)| !v && *e > at);
        live.map(|(a, _, _)| a).sum()
    }

    /// The ledger stamps a transfer no earlier than it was sent: here exactly then (the worst case).
    fn pending(&mut self, amount: u64, timeout_seconds: u32, now: Instant) -> Option<u128> {
        if CAPACITY - self.held(now) < amount {
            return None;
        }
        self.next_id += 1;
        let expires_at = now + Duration::from_secs(timeout_seconds.into());
        self.pendings
            .insert(self.next_id, (amount, expires_at, false));
        Some(self.next_id)
    }
}

#[derive(Clone)]
struct ModelStore {
    model: Arc<Mutex<Model>>,
    clock: TestClock,
}

fn timeout() -> LedgerError {
    LedgerError::Timeout {
        operation: Operation::CreateTransfers,
    }
}

impl ModelStore {
    /// Moves the clock L on: the current lease admits no more, and its settlement is due.
    fn past_l(&self) {
        let after_l = self.clock.now() + Duration::from_secs(u64::from(LEASE_SECONDS));
        self.clock.advance_to(after_l);
    }

    async fn yield_if_asked(&self) {
        let yields = self.model.lock().unwrap().yields;
        if yields {
            tokio::task::yield_now().await;
        }
    }

    /// The next ledger call meets `fault`.
    fn next_call(&self, fault: Fault) {
        self.model.lock().unwrap().faults.push_back(fault);
    }

    /// Runs `apply` unless the next fault says it is never applied; hides its answer if lost.
    fn faulty<T>(&self, apply: impl FnOnce(&mut Model, Instant) -> T) -> Result<T, LedgerError> {
        let mut model = self.model.lock().unwrap();
        let fault = model.faults.pop_front();
        if fault == Some(Fault::NotApplied) {
            return Err(timeout());
        }
        let answer = apply(&mut model, self.clock.now());
        match fault {
            Some(Fault::LostReply) => Err(timeout()),
            _ => Ok(answer),
        }
    }

    fn place(
        &self,
        amount: u64,
        timeout_seconds: u32,
        lease: bool,
    ) -> Result<HoldReply, LedgerError> {
        self.faulty(|model, now| {
            if model.blocked {
                return HoldReply::Blocked;
            }
            match model.pending(amount, timeout_seconds, now) {
                Some(transfer_id) => {
                    model.leases += u64::from(lease);
                    model.holds += u64::from(!lease);
                    HoldReply::Held {
                        roundtrip: Roundtrip::at(now),
                        transfer_id,
                    }
                }
                None => HoldReply::ExceedsCredits,
            }
        })
    }
}

impl Store for ModelStore {
    fn ledger_id(&self) -> u32 {
        LEDGER_REQUEST_RATE
    }

    async fn hold(
        &self,
        _: u128,
        amount: u64,
        timeout_seconds: u32,
        _: Instant,
        _: bool,
    ) -> Result<HoldReply, LedgerError> {
        self.yield_if_asked().await;
        if self.model.lock().unwrap().holds_time_out {
            return Err(timeout());
        }
        self.place(amount, timeout_seconds, false)
    }

    async fn void(&self, pending_id: u128, _: Instant) -> Result<bool, LedgerError> {
        self.yield_if_asked().await;
        self.faulty(|model, now| match model.pendings.get_mut(&pending_id) {
            Some((_, expires_at, voided)) if !*voided && *expires_at > now => {
                *voided = true;
                true
            }
            _ => false,
        })
    }

    async fn provision(&self, _: &UserAccount, _: Instant) -> Result<(), LedgerError> {
        Ok(())
    }

    async fn account_view(
        &self,
        _: u128,
        _: u32,
        _: Instant,
    ) -> Result<Option<AccountView>, LedgerError> {
        let model = self.model.lock().unwrap();
        let (now, wall) = (self.clock.now(), self.clock.wall());
        let mut holds: Vec<Hold> = (model.pendings.iter())
            .filter(|(_, (_, e, v))| !v && *e > now)
            .map(|(id, (amount, e, _))| Hold {
                id: *id,
                amount: *amount,
                expires_at: wall + (*e - now),
                leased_at: None,
            })
            .collect();
        holds.sort_by_key(|h| h.expires_at);
        // A block lasts a minute here, unless a test says otherwise.
        let block = Duration::from_secs(model.block_seconds.unwrap_or(60));
        let blocked = (model.blocked).then(|| crate::ledger::Blocked {
            until: Some(wall + block),
            moved_to: None,
        });
        Ok(Some(AccountView {
            credit: CAPACITY,
            granted: true,
            available: CAPACITY - model.held(now),
            holds,
            complete: true,
            blocked,
        }))
    }

    async fn hold_chain(
        &self,
        _: Vec<crate::ledger::ChainLink>,
        _: Instant,
        _: bool,
    ) -> Result<crate::ledger::ChainReply, LedgerError> {
        // Lease plans decide one limit at a time: a chain here is a bug in the limiter.
        panic!("leases never place chains")
    }

    async fn ping(&self, _: Instant) -> Result<(), LedgerError> {
        Ok(())
    }

    fn record_error(&self, _: &LedgerError) {}

    async fn take_lease(
        &self,
        _: u128,
        units: u64,
        timeout_seconds: u32,
        _: Instant,
    ) -> Result<HoldReply, LedgerError> {
        self.yield_if_asked().await;
        let (hang, answer_on) = {
            let mut model = self.model.lock().unwrap();
            model.lease_calls += 1;
            if model.overload_leases {
                return Err(LedgerError::Overloaded { in_flight_max: 1 });
            }
            let slow = std::mem::take(&mut model.slow_next_lease);
            self.clock.advance_to(self.clock.now() + slow);
            let answer_on = model.answer_next_lease_on.take();
            (std::mem::take(&mut model.hang_next_lease), answer_on)
        };
        if hang {
            std::future::pending::<()>().await;
        }
        let placed = self.place(units, timeout_seconds, true);
        if let Some(answer_on) = answer_on {
            answer_on.await.unwrap();
        }
        // Stamped when sent (above), and said answered `lease_latency` later. (The clock is
        // not moved: the run records each admission at the clock's time, and a request admitted
        // before a renewal that `check` runs would be recorded late.)
        let latency = self.model.lock().unwrap().lease_latency;
        placed.map(|reply| match reply {
            HoldReply::Held {
                roundtrip,
                transfer_id,
            } => HoldReply::Held {
                roundtrip: Roundtrip {
                    sent_at: roundtrip.sent_at,
                    answered_at: roundtrip.answered_at + latency,
                },
                transfer_id,
            },
            other => other,
        })
    }

    async fn settle_lease(
        &self,
        settlement: Settlement,
        deadline: Instant,
    ) -> Result<Settled, LedgerError> {
        // As the ledger's client: a call with no time left is not sent.
        if self.clock.now() >= deadline {
            return Err(timeout());
        }
        self.yield_if_asked().await;
        if std::mem::take(&mut self.model.lock().unwrap().overload_next_settlement) {
            return Err(LedgerError::Overloaded { in_flight_max: 1 });
        }
        let settled = self.apply_settlement(settlement);
        let hang = std::mem::take(&mut self.model.lock().unwrap().hang_next_settlement);
        if hang {
            std::future::pending::<()>().await;
        }
        settled
    }
}

impl ModelStore {
    fn apply_settlement(&self, settlement: Settlement) -> Result<Settled, LedgerError> {
        self.faulty(|model, now| {
            let Some((_, expires_at, voided)) = model.pendings.get_mut(&settlement.lease_id) else {
                return Settled::LeaseGone;
            };
            if *voided || *expires_at <= now {
                return Settled::LeaseGone;
            }
            // A closed account takes a void, but not the used units' new hold: nothing changes.
            if model.blocked && settlement.units_used > 0 {
                return Settled::AccountClosed;
            }
            // The linked chain: the void and the new hold at one timestamp.
            *voided = true;
            if settlement.units_used > 0 {
                let held = model.pending(settlement.units_used, settlement.window_seconds, now);
                assert!(held.is_some(), "the void freed at least the units used");
            }
            model.settlements += 1;
            Settled::Done
        })
    }
}

type Instance = Limiter<ModelStore, TestClock>;

fn terms() -> LeaseTerms {
    LeaseTerms {
        units_max: NonZeroU64::new(LEASE_UNITS_MAX).unwrap(),
        seconds: NonZeroU32::new(LEASE_SECONDS).unwrap(),
    }
}

/// A runtime for one test, and an empty ledger model on a manual clock starting now.
fn runtime_and_store() -> (tokio::runtime::Runtime, ModelStore) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let clock = TestClock(Arc::new(Mutex::new((Instant::now(), SystemTime::now()))));
    let store = ModelStore {
        model: Arc::new(Mutex::new(Model::default())),
        clock,
    };
    (runtime, store)
}

fn instance(store: &ModelStore) -> Instance {
    instance_with(store, FailurePolicy::Closed)
}

fn instance_with(store: &ModelStore, failure_policy: FailurePolicy) -> Instance {
    instance_timed(store, failure_policy, Duration::from_millis(500))
}

/// An instance whose decisions have `ledger_timeout` each.
fn instance_timed(
    store: &ModelStore,
    failure_policy: FailurePolicy,
    ledger_timeout: Duration,
) -> Instance {
    gated_instance(store, failure_policy, ledger_timeout).leasing_at_first_request()
}

/// [`instance_timed`] whose callers take a lease only once their demand is seen, as in service.
fn gated_instance(
    store: &ModelStore,
    failure_policy: FailurePolicy,
    ledger_timeout: Duration,
) -> Instance {
    gated_instance_remembering(store, (failure_policy, ledger_timeout), 100)
}

/// [`gated_instance`] whose local view remembers `local_callers_max` callers.
fn gated_instance_remembering(
    store: &ModelStore,
    (failure_policy, ledger_timeout): (FailurePolicy, Duration),
    local_callers_max: usize,
) -> Instance {
    let lease = terms();
    let capacity = NonZeroU64::new(CAPACITY).unwrap();
    let window = NonZeroU32::new(WINDOW_SECONDS).unwrap();
    let plan = Plan::new("hot", capacity, window)
        .unwrap()
        .with_lease(lease)
        .unwrap();
    let plans = PlanBook::new(vec![plan], "hot", [], [], UnknownKeys::DefaultPlan).unwrap();
    let settings = LimiterSettings {
        ledger_timeout,
        failure_policy,
        local_callers_max,
        expiry_margin: Duration::ZERO,
    };
    Limiter::with_seams(
        store.clone(),
        store.clock.clone(),
        Arc::new(plans),
        settings,
    )
}

#[derive(Debug, Clone)]
enum Event {
    Request {
        instance: usize,
        cost: u64,
    },
    /// A request as the HTTP middleware makes it ([`as_the_middleware`]).
    FastRequest {
        instance: usize,
        cost: u64,
    },
    /// Two requests decided together (joined), each on its instance.
    Together {
        instances: (usize, usize),
        costs: (u64, u64),
    },
    Advance {
        ms: u64,
    },
    Sweep {
        instance: usize,
    },
    /// The instance dies: its leases stay in the ledger, unsettled.
    Kill {
        instance: usize,
    },
    Fault(Fault),
    /// Lease answers take this long from now on.
    LeaseLatency {
        ms: u64,
    },
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        4 => (0..2usize, 1..4u64).prop_map(|(instance, cost)| Event::Request { instance, cost }),
        4 => (0..2usize, 1..4u64)
            .prop_map(|(instance, cost)| Event::FastRequest { instance, cost }),
        3 => ((0..2usize, 0..2usize), (1..4u64, 1..4u64))
            .prop_map(|(instances, costs)| Event::Together { instances, costs }),
        3 => (0..400u64).prop_map(|ms| Event::Advance { ms }),
        1 => (400..4000u64).prop_map(|ms| Event::Advance { ms }),
        2 => (0..2usize).prop_map(|instance| Event::Sweep { instance }),
        1 => (0..2usize).prop_map(|instance| Event::Kill { instance }),
        1 => prop_oneof![Just(Fault::LostReply), Just(Fault::NotApplied)].prop_map(Event::Fault),
        1 => (0..600u64).prop_map(|ms| Event::LeaseLatency { ms }),
    ]
}

/// The one caller every test here leases for.
fn hot_key() -> CallerKey {
    CallerKey::from_header_value("x-api-key", b"hot", 64).unwrap()
}

/// One request decided as the HTTP middleware decides it: from memory when it can, else by
/// `check_with`; either way, the renewal the admission made due runs after the answer.
fn as_the_middleware(
    runtime: &tokio::runtime::Runtime,
    limiter: &Instance,
    key: &CallerKey,
    cost: NonZeroU64,
) -> Outcome {
    let (decision, renewal) = match leased_from_memory(limiter, key, cost) {
        Some(fast) => fast,
        None => runtime
            .block_on(limiter.check_with(key, cost, &[]))
            .unwrap(),
    };
    if let Some(renewal) = renewal {
        runtime.block_on(limiter.renew_lease_ahead(renewal));
    }
    decision.outcome
}

/// The invariant at `at`: the ledger holds at least the units admitted in the last window.
fn invariant(
    store: &ModelStore,
    at: Instant,
    admitted: &[(Instant, u64)],
) -> Result<(), TestCaseError> {
    let due: u64 = (admitted.iter())
        .filter(|(t, _)| *t + WINDOW > at)
        .map(|(_, c)| c)
        .sum();
    let held = store.model.lock().unwrap().held(at);
    prop_assert!(
        held >= due,
        "held {held} < admitted in the last window {due}"
    );
    Ok(())
}

/// When the model's pendings expire from now until `to`, in order.
fn expiries_until(store: &ModelStore, to: Instant) -> Vec<Instant> {
    let now = store.clock.now();
    let model = store.model.lock().unwrap();
    let mut expiries: Vec<Instant> = (model.pendings.values())
        .map(|p| p.1)
        .filter(|e| *e > now && *e <= to)
        .collect();
    expiries.sort();
    expiries
}

/// Two requests of `costs` decided together (joined) on `instances`: the costs admitted.
fn together(
    runtime: &tokio::runtime::Runtime,
    instances: (&Instance, &Instance),
    key: &CallerKey,
    costs: (u64, u64),
) -> Vec<u64> {
    let (one, two) = runtime.block_on(async {
        let one = instances.0.check(key, NonZeroU64::new(costs.0).unwrap());
        let two = instances.1.check(key, NonZeroU64::new(costs.1).unwrap());
        tokio::join!(one, two)
    });
    [(one, costs.0), (two, costs.1)]
        .into_iter()
        .filter(|(decision, _)| decision.as_ref().unwrap().outcome == Outcome::Admitted)
        .map(|(_, cost)| cost)
        .collect()
}

/// Runs `events`; checks the invariant at each event and at every expiry in between.
fn run(events: &[Event]) -> Result<(u64, Model), TestCaseError> {
    let (runtime, store) = runtime_and_store();
    store.model.lock().unwrap().yields = true;
    let clock = store.clock.clone();
    // The second instance as in service: a caller's lease waits for its demand to be seen.
    let instance_of = |i: usize| match i {
        0 => instance(&store),
        _ => gated_instance(&store, FailurePolicy::Closed, Duration::from_millis(500)),
    };
    let mut instances = [instance_of(0), instance_of(1)];
    let key = hot_key();
    let mut admitted: Vec<(Instant, u64)> = Vec::new();
    let check = |at: Instant, admitted: &[(Instant, u64)]| invariant(&store, at, admitted);
    for event in events {
        match event {
            Event::Request { instance, cost } => {
                let cost = NonZeroU64::new(*cost).unwrap();
                let decision = runtime
                    .block_on(instances[*instance].check(&key, cost))
                    .unwrap();
                if decision.outcome == Outcome::Admitted {
                    admitted.push((clock.now(), cost.get()));
                }
            }
            Event::FastRequest { instance, cost } => {
                let cost = NonZeroU64::new(*cost).unwrap();
                let outcome = as_the_middleware(&runtime, &instances[*instance], &key, cost);
                if outcome == Outcome::Admitted {
                    admitted.push((clock.now(), cost.get()));
                }
            }
            Event::Together {
                instances: (a, b),
                costs,
            } => {
                let pair = (&instances[*a], &instances[*b]);
                for cost in together(&runtime, pair, &key, *costs) {
                    admitted.push((clock.now(), cost));
                }
            }
            Event::Advance { ms } => {
                let to = clock.now() + Duration::from_millis(*ms);
                for at in expiries_until(&store, to) {
                    check(at, &admitted)?;
                }
                clock.advance_to(to);
            }
            Event::Sweep { instance } => {
                runtime.block_on(instances[*instance].settle_due_leases());
            }
            Event::Kill { instance } => instances[*instance] = instance_of(*instance),
            Event::Fault(fault) => store.next_call(*fault),
            Event::LeaseLatency { ms } => {
                store.model.lock().unwrap().lease_latency = Duration::from_millis(*ms);
            }
        }
        check(clock.now(), &admitted)?;
    }
    let total = admitted.iter().map(|(_, c)| c).sum();
    let mut model = std::mem::take(&mut *store.model.lock().unwrap());
    model.ended_at = Some(clock.now());
    Ok((total, model))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Never over-admit: two instances, one hot caller, random requests, time, sweeps, deaths and
    /// lost or unapplied ledger calls.
    #[test]
    fn leases_never_over_admit(events in proptest::collection::vec(event(), 1..400)) {
        run(&events)?;
    }
}

/// The case `proptest-regressions/limiter/lease/tests.txt`'s seed shrank to when it caught a
/// deliberate bug (admitting past L). Pinned as itself: a saved seed replays another case once
/// `event()` changes, as it has since.
#[test]
fn a_request_after_the_lease_time_is_not_admitted_from_the_old_lease() {
    let events = [
        Event::Request {
            instance: 0,
            cost: 1,
        },
        Event::Advance { ms: 1001 },
        Event::Request {
            instance: 0,
            cost: 1,
        },
        Event::Advance { ms: 2999 },
    ];
    run(&events).unwrap();
}

/// The host slept past the lease's time: `Instant` (Linux's `CLOCK_MONOTONIC`) stood still
/// while the ledger's clock went on and expired the lease, so nothing holds its units any more;
/// the wall clock says L is over, and nothing more is admitted from it. A wall clock set back
/// lengthens no lease.
#[test]
fn a_lease_admits_nothing_once_either_clock_says_its_time_is_over() {
    let (_runtime, store, limiter, key) = with_a_first_lease();
    let from_lease = || leased_from_memory(&limiter, &key, NonZeroU64::MIN).is_some();
    assert!(from_lease(), "room, in time");
    let slept = WINDOW + Duration::from_secs(u64::from(LEASE_SECONDS) + 1);
    store.clock.advance_wall(slept);
    assert!(!from_lease(), "over by the wall clock");
    let (_runtime, store, limiter, key) = with_a_first_lease();
    let from_lease = || leased_from_memory(&limiter, &key, NonZeroU64::MIN).is_some();
    store.clock.set_wall_back(slept);
    assert!(from_lease(), "the wall clock set back: still in time");
    store.past_l();
    assert!(!from_lease(), "over by the monotonic clock");
}

/// A renewal ahead of need that the ledger refused (credit held elsewhere) is not asked again
/// by every later admission from the same lease: one ledger call, not one per request.
/// A hot caller whose first request took its first lease (8 units).
fn with_a_first_lease() -> (tokio::runtime::Runtime, ModelStore, Instance, CallerKey) {
    let (runtime, store) = runtime_and_store();
    let limiter = instance(&store);
    let key = hot_key();
    let first = runtime.block_on(limiter.check(&key, NonZeroU64::MIN));
    assert!(first.unwrap().leased.is_some(), "the first lease: 8 units");
    (runtime, store, limiter, key)
}

#[test]
fn a_refused_renewal_ahead_is_not_asked_again_from_the_same_lease() {
    let (runtime, store, limiter, key) = with_a_first_lease();
    let one = NonZeroU64::MIN;
    // Everything else is held elsewhere.
    let now = store.clock.now();
    let rest = CAPACITY - store.model.lock().unwrap().held(now);
    store
        .model
        .lock()
        .unwrap()
        .pending(rest, WINDOW_SECONDS, now);
    for _ in 2..=8 {
        let decision = runtime.block_on(limiter.check(&key, one)).unwrap();
        assert!(decision.leased.is_some(), "admitted from the lease");
    }
    // The first lease, and the one renewal ahead (at 4 of 8 used), which the ledger refused.
    assert_eq!(store.model.lock().unwrap().lease_calls, 2);
}

/// A renewal ahead refused a place under a full in-flight bound is not tried again from the same
/// lease: each admission from its second half sent one more, each refused at once.
#[test]
fn a_renewal_ahead_refused_a_place_is_not_tried_again_from_the_same_lease() {
    let (runtime, store, limiter, key) = with_a_first_lease();
    let one = NonZeroU64::MIN;
    store.model.lock().unwrap().overload_leases = true;
    for _ in 2..=8 {
        let decision = runtime.block_on(limiter.check(&key, one)).unwrap();
        assert!(decision.leased.is_some(), "admitted from the lease");
    }
    // The first lease, and the one renewal ahead (at 4 of 8 used), refused a place.
    assert_eq!(store.model.lock().unwrap().lease_calls, 2);
}

/// An operator's block (or a move) while a caller admits from a lease: the renewal that finds
/// the account closed retires the lease, so memory stops admitting the caller at once, not L
/// later.
#[test]
fn a_block_retires_the_lease_at_its_next_renewal() {
    let (runtime, store) = runtime_and_store();
    let limiter = instance(&store);
    let key = hot_key();
    let one = NonZeroU64::MIN;
    runtime.block_on(limiter.check(&key, one)).unwrap();
    store.model.lock().unwrap().blocked = true;
    // 2 and 3 from the lease; 4 starts the renewal ahead, which finds the account closed.
    for _ in 2..=4 {
        let decision = runtime.block_on(limiter.check(&key, one)).unwrap();
        assert_eq!(decision.outcome, Outcome::Admitted);
    }
    let after = runtime.block_on(limiter.check(&key, one)).unwrap();
    assert!(after.leased.is_none(), "admitted from a retired lease");
    assert_ne!(after.outcome, Outcome::Admitted);
}

/// A renewal that finds the account closed answers its request with the ledger's refusal, whatever
/// the failure policy: decided per request after it, a hold that then failed went to the policy,
/// and fail-open admitted the caller the ledger had just called blocked.
#[test]
fn a_lease_refused_on_a_closed_account_is_refused_under_fail_open() {
    let (runtime, store) = runtime_and_store();
    let limiter = instance_with(&store, FailurePolicy::Open);
    let key = hot_key();
    let one = NonZeroU64::MIN;
    runtime.block_on(limiter.check(&key, one)).unwrap();
    {
        let mut model = store.model.lock().unwrap();
        model.blocked = true;
        model.holds_time_out = true;
    }
    // 2 and 3 from the lease; 4 starts the renewal ahead, which finds the account closed.
    for _ in 2..=4 {
        let decision = runtime.block_on(limiter.check(&key, one)).unwrap();
        assert_eq!(decision.outcome, Outcome::Admitted);
    }
    let after = runtime.block_on(limiter.check(&key, one)).unwrap();
    assert!(
        matches!(after.outcome, Outcome::Blocked { .. }),
        "{:?}",
        after.outcome
    );
}

/// A hot caller as in service (its lease taken once its demand was seen), blocked: the renewal
/// ahead that finds the account closed runs after its request's answer, and its word is kept for
/// the next request (and, past a minute idle, for the failure policy): decided per request
/// instead (no demand seen within L), its hold failed and fail-open admitted the blocked caller.
/// Unblocked meanwhile (the account reads open), it is decided per request, not refused.
#[test]
fn a_renewal_ahead_that_finds_the_account_closed_refuses_the_next_request() {
    for (unblocked, idle_s) in [(false, 2), (true, 2), (false, 61)] {
        let (runtime, store) = runtime_and_store();
        let timeout = Duration::from_millis(500);
        let limiter = gated_instance(&store, FailurePolicy::Open, timeout);
        let key = hot_key();
        let one = NonZeroU64::MIN;
        runtime.block_on(limiter.check(&key, one)).unwrap(); // per request
        let leased = runtime.block_on(limiter.check(&key, one)).unwrap();
        assert!(leased.leased.is_some(), "its demand seen: a lease");
        {
            let mut model = store.model.lock().unwrap();
            model.blocked = true;
            model.block_seconds = Some(3_600);
        }
        // From the lease until the renewal ahead (at half its units) finds the account closed.
        for _ in 0..3 {
            let decision = runtime.block_on(limiter.check(&key, one)).unwrap();
            assert!(decision.leased.is_some());
        }
        assert_eq!(
            store.model.lock().unwrap().lease_calls,
            2,
            "the renewal ran"
        );
        // Idle past L, and past the sweeps that forget a caller without a lease.
        for _ in 0..idle_s {
            store.past_l();
            for _ in 0..3 {
                runtime.block_on(limiter.settle_due_leases());
            }
        }
        {
            let mut model = store.model.lock().unwrap();
            model.holds_time_out = true;
            model.blocked = !unblocked;
        }
        if unblocked {
            // The unblock's operator epoch reaches this instance: its view is cleared.
            limiter.forget_all_local();
        }
        let next = runtime.block_on(limiter.check(&key, one)).unwrap();
        let blocked = matches!(next.outcome, Outcome::Blocked { .. });
        assert_eq!(blocked, !unblocked, "{:?}", next.outcome);
        if unblocked {
            // Per request, its hold timed out: the policy's answer, not a refusal.
            assert!(
                matches!(next.outcome, Outcome::FailedOpen(_)),
                "{:?}",
                next.outcome
            );
        }
    }
}

/// Once this instance has read a caller's block, its requests are refused from memory: on a
/// lease plan, each first tried a lease (a ledger write, refused `Blocked`) before the view's 403,
/// so a blocked caller drove a write per request where a per-request plan's drives none.
#[test]
fn a_blocked_caller_costs_no_lease_attempt_once_its_block_is_read() {
    let (runtime, store) = runtime_and_store();
    let limiter = instance(&store);
    let key = hot_key();
    let one = NonZeroU64::MIN;
    runtime.block_on(async {
        limiter.check(&key, one).await.unwrap();
        store.model.lock().unwrap().blocked = true;
        // Until the block is read: the lease's renewal, then a refusal read for why.
        let from_memory = |d: &Decision<'_>| {
            matches!(
                d.outcome,
                Outcome::Blocked {
                    source: DecisionSource::LocalView,
                    ..
                }
            )
        };
        let mut read = false;
        for _ in 0..20 {
            if from_memory(&limiter.check(&key, one).await.unwrap()) {
                read = true;
                break;
            }
        }
        assert!(read, "the block is read");
        let calls = store.model.lock().unwrap().lease_calls;
        for _ in 0..10 {
            assert!(from_memory(&limiter.check(&key, one).await.unwrap()));
        }
        assert_eq!(
            store.model.lock().unwrap().lease_calls,
            calls,
            "no lease tried"
        );
    });
}

/// An operator acts (here a block) while a renewal ahead is in flight, its lease placed just
/// before: the epoch follower's settle cannot take that lease, which is not yet installed, so the
/// renewal must not install it either. Installed, it admitted from memory past the block until
/// its own renewal, up to L/2 later.
#[test]
fn a_lease_taken_while_every_lease_is_settled_is_not_installed() {
    let (runtime, store) = runtime_and_store();
    let limiter = instance(&store);
    let key = hot_key();
    let one = NonZeroU64::MIN;
    runtime.block_on(async {
        limiter.check(&key, one).await.unwrap();
        for _ in 2..=3 {
            let decision = limiter.check(&key, one).await.unwrap();
            assert_eq!(decision.outcome, Outcome::Admitted);
        }
        let (answer, answer_on) = tokio::sync::oneshot::channel();
        store.model.lock().unwrap().answer_next_lease_on = Some(answer_on);
        // The 4th is admitted from the lease and renews ahead: the next lease is placed, and its
        // answer waits.
        let fourth = limiter.check(&key, one);
        tokio::pin!(fourth);
        let early = tokio::time::timeout(Duration::from_millis(20), &mut fourth).await;
        assert!(early.is_err(), "the renewal waits for its answer");
        assert_eq!(
            store.model.lock().unwrap().leases,
            2,
            "the next lease is placed"
        );
        store.model.lock().unwrap().blocked = true;
        assert_eq!(limiter.settle_all_leases().await, 1, "the current lease");
        answer.send(()).unwrap();
        assert_eq!(fourth.await.unwrap().outcome, Outcome::Admitted);
        let after = limiter.check(&key, one).await.unwrap();
        assert!(
            after.leased.is_none(),
            "admitted from a lease taken before the block"
        );
        assert_ne!(after.outcome, Outcome::Admitted);
    });
    let model = store.model.lock().unwrap();
    let (units, _, voided) = model.pendings[&2];
    assert!(
        units > 0 && voided,
        "the lease taken as the block came was voided"
    );
    // The lease before the block holds on whole: a closed account takes no new hold.
    assert_eq!(model.held(store.clock.now()), model.pendings[&1].0);
}

fn requests(instance: usize, count: usize) -> Vec<Event> {
    vec![Event::Request { instance, cost: 1 }; count]
}

#[test]
fn a_hot_caller_is_admitted_from_leases() {
    // 4 requests per second, half the plan's rate, on one instance for 12 s: all admitted, and
    // most from leases in memory. On the instance as in service (its first lease once the
    // caller's demand is seen).
    let mut events = Vec::new();
    for _ in 0..48 {
        events.extend(requests(1, 1));
        events.push(Event::Advance { ms: 250 });
        events.push(Event::Sweep { instance: 1 });
    }
    let (admitted, model) = run(&events).unwrap();
    let transfers = model.pendings.len() as u64;
    eprintln!(
        "admitted {admitted}, transfers {transfers}, leases {}, settlements {}",
        model.leases, model.settlements
    );
    assert_eq!(admitted, 48);
    assert!(model.leases >= 2 && model.settlements >= 1);
    assert!(model.holds <= 1, "{} holds per request", model.holds);
}

/// [`Limiter::from_memory`]'s admission from the lease (a lease plan never refuses from memory).
fn leased_from_memory<'a>(
    limiter: &'a Instance,
    key: &CallerKey,
    cost: NonZeroU64,
) -> Option<(Decision<'a>, Option<RenewalAhead>)> {
    match limiter.from_memory(key, cost, true)? {
        FromMemory::Leased(decision, renewal) => Some((decision, renewal)),
        FromMemory::Refused(_) => panic!("a lease plan refused from memory"),
    }
}

/// The rest of [`with_a_first_lease`]'s lease admitted from memory, a unit at a time; the
/// renewal ahead that made due, unrun.
fn spend_the_first_lease(limiter: &Instance, key: &CallerKey) -> Option<RenewalAhead> {
    let mut due = None;
    for _ in 2..=super::LEASE_UNITS_FIRST {
        let (fast, renewal) = leased_from_memory(limiter, key, NonZeroU64::MIN).expect("room");
        assert_eq!(fast.outcome, Outcome::Admitted);
        due = due.or(renewal);
    }
    due
}

/// The middleware admits from a lease without the async path: while the lease has room, spending
/// the same units `check` would, with no ledger call; the admission that makes the renewal due
/// hands it over to be run after the answer, and a renewal dropped unrun ends.
#[test]
fn memory_alone_admits_from_a_lease_and_hands_its_renewal_over() {
    let (runtime, store) = runtime_and_store();
    let limiter = instance(&store);
    let key = hot_key();
    let one = NonZeroU64::MIN;
    assert!(
        leased_from_memory(&limiter, &key, one).is_none(),
        "no lease yet"
    );
    let first = runtime.block_on(limiter.check(&key, one)).unwrap();
    let lease = first.leased.expect("admitted from the first lease");
    let transfers = store.model.lock().unwrap().pendings.len();
    // The first lease has 8 units; its renewal is due once 4 are used.
    let mut remaining = first.quota.remaining;
    let mut renewal = None;
    for used in 2..=4 {
        let (fast, due) = leased_from_memory(&limiter, &key, one).expect("room");
        assert_eq!(fast.outcome, Outcome::Admitted);
        let receipt = fast.leased.map(|l| (l.lease_id, l.units));
        assert_eq!(receipt, Some((lease.lease_id, 1)));
        assert!(fast.hold.is_none());
        assert_eq!(fast.quota.remaining, remaining - 1);
        remaining = fast.quota.remaining;
        assert_eq!(due.is_some(), used == 4, "{used} units used");
        renewal = renewal.or(due);
    }
    assert_eq!(
        store.model.lock().unwrap().pendings.len(),
        transfers,
        "no ledger call yet"
    );
    // While that renewal is out, the lease still admits, and no other renewal starts.
    let (_, again) = leased_from_memory(&limiter, &key, one).expect("room");
    assert!(again.is_none());
    runtime.block_on(limiter.renew_lease_ahead(renewal.expect("due at 4 units")));
    assert!(store.model.lock().unwrap().pendings.len() > transfers);
    let (renewed, _) = leased_from_memory(&limiter, &key, one).expect("the next lease");
    assert_ne!(renewed.leased.map(|l| l.lease_id), Some(lease.lease_id));
    // Past half the lease's time a renewal is due again; dropped unrun, it ends, and the next
    // admission starts it anew (rather than every request waiting on one that never runs).
    store
        .clock
        .advance_to(store.clock.now() + Duration::from_millis(600));
    let (_, due) = leased_from_memory(&limiter, &key, one).expect("room");
    drop(due.expect("half the lease's time is over"));
    let (_, due) = leased_from_memory(&limiter, &key, one).expect("room");
    assert!(due.is_some(), "the dropped renewal ended");
    // A cost above the lease's size never comes from a lease.
    let large = NonZeroU64::new(LEASE_UNITS_MAX + 1).unwrap();
    assert!(leased_from_memory(&limiter, &key, large).is_none());
}

/// When memory alone cannot decide, the middleware asks `check_with`: it too leaves the renewal
/// its admission made due to its caller, and the request does not wait for the ledger.
#[test]
fn check_with_leaves_the_renewal_to_its_caller() {
    let (runtime, store) = runtime_and_store();
    let pendings = || store.model.lock().unwrap().pendings.len();
    let key = hot_key();
    let one = NonZeroU64::MIN;
    let leaving = instance(&store);
    let checked = leaving.check_with(&key, one, &[]);
    let (first, renewal) = runtime.block_on(checked).unwrap();
    assert!(renewal.is_none(), "the first lease was taken, not renewed");
    let lease_id = first
        .leased
        .expect("admitted from the first lease")
        .lease_id;
    let before = pendings();
    // The first lease has 8 units; its renewal is due once 4 are used.
    let mut renewal = None;
    for used in 2..=4 {
        let (decision, due) = runtime
            .block_on(leaving.check_with(&key, one, &[]))
            .unwrap();
        assert_eq!(decision.outcome, Outcome::Admitted);
        assert_eq!(decision.leased.map(|l| l.lease_id), Some(lease_id));
        assert_eq!(due.is_some(), used == 4, "{used} units used");
        renewal = renewal.or(due);
    }
    assert_eq!(pendings(), before, "no request waited for a renewal");
    runtime.block_on(leaving.renew_lease_ahead(renewal.expect("due at 4 units")));
    // The next lease, and the settlement of the one it replaced (a hold of the units it admitted).
    assert_eq!(pendings(), before + 2, "the renewal ran");
}

/// `check` (the library's call) runs the renewal its admission made due before it returns.
#[test]
fn check_runs_the_renewal_before_it_returns() {
    let (runtime, store) = runtime_and_store();
    let pendings = || store.model.lock().unwrap().pendings.len();
    let key = hot_key();
    let one = NonZeroU64::MIN;
    let running = instance(&store);
    let first = runtime.block_on(running.check(&key, one)).unwrap();
    assert!(first.leased.is_some(), "admitted from its first lease");
    let before = pendings();
    for _ in 2..=3 {
        runtime.block_on(running.check(&key, one)).unwrap();
    }
    assert_eq!(pendings(), before);
    let fourth = runtime.block_on(running.check(&key, one)).unwrap();
    assert_eq!(fourth.outcome, Outcome::Admitted);
    assert_eq!(pendings(), before + 2, "check renewed before it returned");
}

#[test]
fn unused_leased_units_come_back_within_l() {
    let mut events = requests(0, 3);
    // Within L: the first lease is held whole.
    events.push(Event::Advance { ms: 999 });
    let within = run(&events).unwrap().1;
    let first = super::LEASE_UNITS_FIRST;
    assert_eq!(within.held(within.ended_at.unwrap()), first);
    events.push(Event::Advance { ms: 1 });
    events.push(Event::Sweep { instance: 0 });
    let (admitted, model) = run(&events).unwrap();
    assert_eq!(admitted, 3);
    assert_eq!(model.settlements, 1);
    let live: u64 = model.pendings.values().filter(|p| !p.2).map(|p| p.0).sum();
    assert_eq!(live, 3, "after L only the units used are held");
}

#[test]
fn a_killed_instance_leaves_its_lease_to_cover_what_it_admitted() {
    // Three of the first lease's eight units: no renewal yet, so lease 1 is the one it dies with.
    let mut events = requests(0, 3);
    events.push(Event::Kill { instance: 0 });
    events.extend(requests(1, 40));
    events.push(Event::Advance { ms: 3500 });
    events.extend(requests(1, 40));
    let (admitted, model) = run(&events).unwrap();
    assert!(admitted <= 2 * CAPACITY);
    let first_lease = model.pendings[&1];
    assert!(
        !first_lease.2,
        "nobody settles (voids) a dead instance's lease"
    );
}

#[test]
fn a_renewal_dropped_midway_does_not_block_the_callers_other_requests() {
    let (runtime, store) = runtime_and_store();
    let limiter = instance(&store);
    let key = hot_key();
    store.model.lock().unwrap().hang_next_lease = true;
    runtime.block_on(async {
        // The client goes away while its request renews the lease.
        let abandoned = limiter.check(&key, NonZeroU64::MIN);
        let gone = tokio::time::timeout(Duration::from_millis(20), abandoned).await;
        assert!(gone.is_err(), "the lease call hangs");
        // The next request renews at once instead of waiting for the abandoned renewal: a wait
        // would last the whole deadline (500 ms) and end failed closed.
        let decision = limiter.check(&key, NonZeroU64::MIN).await.unwrap();
        assert_eq!(decision.outcome, Outcome::Admitted);
    });
    assert_eq!(store.model.lock().unwrap().leases, 1);
}

/// A settlement refused a place under the in-flight bound was never sent: the sweeper sends it
/// again at its next tick. It was forgotten, the lease's unused units held for window + L.
#[test]
fn a_settlement_refused_a_place_is_sent_again_by_the_sweeper() {
    let (runtime, store) = runtime_and_store();
    let limiter = instance(&store);
    let key = hot_key();
    runtime.block_on(async {
        let decision = limiter.check(&key, NonZeroU64::MIN).await.unwrap();
        assert_eq!(decision.outcome, Outcome::Admitted);
    });
    store.past_l();
    store.model.lock().unwrap().overload_next_settlement = true;
    runtime.block_on(limiter.settle_due_leases());
    assert_eq!(
        store.model.lock().unwrap().settlements,
        0,
        "refused a place"
    );
    runtime.block_on(limiter.settle_due_leases());
    assert_eq!(store.model.lock().unwrap().settlements, 1, "sent again");
}

/// A renewing request whose client goes away while its lease's settlement is at the ledger: the
/// settlement lands, and the view forgets the caller rather than count the whole lease on (it
/// would refuse from memory what the ledger admits, until the lease's timeout).
#[test]
fn a_settlement_left_unanswered_makes_the_view_forget_the_caller() {
    let (runtime, store) = runtime_and_store();
    let limiter = instance(&store);
    let key = hot_key();
    store.model.lock().unwrap().hang_next_settlement = true;
    runtime.block_on(async {
        for _ in 0..CAPACITY {
            let check = limiter.check(&key, NonZeroU64::MIN);
            match tokio::time::timeout(Duration::from_millis(20), check).await {
                Ok(decision) => assert_eq!(decision.unwrap().outcome, Outcome::Admitted),
                Err(_) => break, // its settlement hangs: the client goes away
            }
        }
    });
    let model = store.model.lock().unwrap();
    assert_eq!(model.settlements, 1, "a settlement landed");
    assert!(!model.hang_next_settlement, "and was never answered");
    assert_eq!(limiter.local_callers(), 0, "the view forgot the caller");
}

/// A renewal that `check` runs within its request's deadline, whose lease call spends it: the
/// lease it replaced cannot be settled by then, and the sweeper settles it (not left held, whole,
/// for window + L).
#[test]
fn a_settlement_past_the_renewals_deadline_is_left_to_the_sweeper() {
    let (runtime, store) = runtime_and_store();
    let limiter = instance(&store);
    let key = hot_key();
    let first = runtime
        .block_on(limiter.check(&key, NonZeroU64::MIN))
        .unwrap();
    let lease_id = first
        .leased
        .expect("admitted from the first lease")
        .lease_id;
    for _ in 2..=3 {
        runtime
            .block_on(limiter.check(&key, NonZeroU64::MIN))
            .unwrap();
    }
    // The fourth admission makes the renewal due; its lease call takes the whole deadline.
    store.model.lock().unwrap().slow_next_lease = Duration::from_millis(600);
    let fourth = runtime
        .block_on(limiter.check(&key, NonZeroU64::MIN))
        .unwrap();
    assert_eq!(fourth.outcome, Outcome::Admitted);
    let voided = |store: &ModelStore| store.model.lock().unwrap().pendings[&lease_id].2;
    assert!(!voided(&store), "not sent past the deadline");
    assert_eq!(runtime.block_on(limiter.settle_due_leases()), 1);
    assert!(voided(&store), "the sweeper settled it");
    let model = store.model.lock().unwrap();
    assert_eq!(model.settlements, 1);
    let held: Vec<u64> = model
        .pendings
        .values()
        .filter(|p| !p.2)
        .map(|p| p.0)
        .collect();
    assert!(
        held.contains(&4),
        "the first lease's four units are held on: {held:?}"
    );
}

/// A sweep's round that starts with its deadline spent sends nothing: its leases are left as
/// they were, for the next sweep at once. Read as an unknown outcome (the ledger's client answers
/// `Timeout` unsent), the view counted them settled while the ledger held them whole, and they
/// waited a ledger timeout more.
#[test]
fn a_settlement_with_no_time_left_is_sent_by_the_next_sweep() {
    let (runtime, store, limiter, _key) = with_a_first_lease();
    store.past_l();
    let spent = store.clock.now();
    let swept = runtime.block_on(limiter.settle_leases((None, false), Some(spent)));
    assert_eq!((swept.due, swept.sent), (1, 0));
    assert_eq!(store.model.lock().unwrap().settlements, 0, "not sent");
    assert_eq!(runtime.block_on(limiter.settle_due_leases()), 1, "no wait");
    assert_eq!(store.model.lock().unwrap().settlements, 1);
}

#[test]
fn a_clean_shutdown_gives_unused_leased_units_back_at_once() {
    let (runtime, store) = runtime_and_store();
    let clock = store.clock.clone();
    let limiter = instance(&store);
    let key = hot_key();
    runtime.block_on(async {
        for _ in 0..3 {
            let decision = limiter.check(&key, NonZeroU64::MIN).await.unwrap();
            assert_eq!(decision.outcome, Outcome::Admitted);
        }
        assert_eq!(limiter.settle_due_leases().await, 0, "L is not over");
        assert_eq!(limiter.settle_all_leases().await, 1);
    });
    let model = store.model.lock().unwrap();
    assert_eq!(model.held(clock.now()), 3, "only the units used stay held");
}

/// A caller refused because of leases is told to wait for their settlement (L plus a sweep), not
/// for their timeout; other holds keep theirs, and the earliest comes first.
#[test]
fn leases_end_at_their_settlement_for_retry_after() {
    let placed = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
    let terms = terms();
    let lease_timeout = WINDOW + Duration::from_secs(LEASE_SECONDS.into());
    let view = AccountView {
        credit: CAPACITY,
        granted: true,
        available: 0,
        holds: vec![
            Hold {
                id: 1,
                amount: 4,
                expires_at: placed + Duration::from_millis(1_500),
                leased_at: None,
            },
            Hold {
                id: 2,
                amount: 20,
                expires_at: placed + lease_timeout,
                leased_at: Some(placed),
            },
        ],
        complete: true,
        blocked: None,
    };
    let settled_within = Duration::from_secs(LEASE_SECONDS.into()) + super::SETTLE_TICK;
    let settled_at = placed + settled_within;
    let expiries = |view: &AccountView| -> Vec<(u64, SystemTime)> {
        view.holds
            .iter()
            .map(|h| (h.amount, h.expires_at))
            .collect()
    };
    let soon = super::settling_soon(view.clone(), terms, placed);
    assert_eq!(
        expiries(&soon),
        [(20, settled_at), (4, placed + Duration::from_millis(1_500))]
    );
    // Listed while its settlement is still to come: that is when it ends, not L from the listing.
    let meanwhile =
        super::settling_soon(view.clone(), terms, settled_at - Duration::from_millis(1));
    assert_eq!(expiries(&meanwhile), expiries(&soon));
    assert!(settled_at < placed + lease_timeout);
    // Listed just after it was due: its settlement is on its way, a tick at most.
    let just = settled_at + Duration::from_millis(1);
    let just_due = super::settling_soon(view.clone(), terms, just);
    assert_eq!(expiries(&just_due)[0], (20, just + super::SETTLE_TICK));
    // Listed well after its settlement was due (its instance died): another L and a sweep from
    // the listing, not forgotten at once.
    let late = settled_at + Duration::from_secs(1);
    let overdue = super::settling_soon(view, terms, late);
    assert_eq!(
        expiries(&overdue),
        [
            (4, placed + Duration::from_millis(1_500)),
            (20, late + settled_within)
        ]
    );
}

/// A decision admitted from a lease, cloned: refunded from both copies, the lease gave its
/// units back twice, made room for requests it never counted, and its settlement held less than
/// was admitted (or the give-back's assertion panicked on a request's path). A clone carries no
/// lease receipt; a receipt that gives back more than the lease admitted is refused.
#[test]
fn a_lease_admission_is_given_back_once_however_its_decision_is_copied() {
    let (runtime, _store, limiter, key) = with_a_first_lease();
    let mut decision = runtime
        .block_on(limiter.check(&key, NonZeroU64::MIN))
        .unwrap();
    let receipt = decision.leased.expect("admitted from the lease");
    let mut copy = decision.clone();
    assert_eq!(copy.leased, None, "a clone has no receipt");
    assert_eq!(runtime.block_on(limiter.refund(&mut decision)), Ok(true));
    assert_eq!(runtime.block_on(limiter.refund(&mut copy)), Ok(false));
    // Two admitted, one given back: one unit is used. A made-up receipt of more is refused.
    let made_up = super::super::LeaseReceipt {
        lease_id: receipt.lease_id,
        units: 2,
    };
    copy.leased = Some(made_up);
    assert_eq!(runtime.block_on(limiter.refund(&mut copy)), Ok(false));
    copy.leased = Some(receipt);
    assert_eq!(runtime.block_on(limiter.refund(&mut copy)), Ok(true));
}

/// A settlement whose outcome is unknown (a timeout, whether it landed or not) is sent again by
/// the next sweep: before, the lease was left to expire, its unused units held for window + L.
/// Sent again, it settles once either way: the retry of one that landed finds the lease gone.
#[test]
fn a_settlement_of_unknown_outcome_is_sent_again() {
    for fault in [Fault::NotApplied, Fault::LostReply] {
        let mut events = requests(0, 3);
        events.push(Event::Advance { ms: 1000 });
        events.push(Event::Fault(fault));
        events.push(Event::Sweep { instance: 0 });
        // Not at once: a ledger timeout (500 ms) doubled first.
        events.push(Event::Sweep { instance: 0 });
        if fault == Fault::NotApplied {
            let (_, model) = run(&events).unwrap();
            let held = model.held(model.ended_at.unwrap());
            assert_eq!(held, super::LEASE_UNITS_FIRST, "not sent again yet");
        }
        events.push(Event::Advance { ms: 1000 });
        events.push(Event::Sweep { instance: 0 });
        let (admitted, model) = run(&events).unwrap();
        assert_eq!(admitted, 3);
        let ended_at = model.ended_at.unwrap();
        assert_eq!(model.held(ended_at), 3, "{fault:?}: only the units used");
        assert_eq!(model.settlements, 1, "{fault:?}: settled once");
    }
}

/// A settlement sent again, seconds after its first try, holds the units used for a window
/// from that first try (nothing was admitted from the lease after it), not from the resend: it
/// held them up to a window past the bound the README states.
#[test]
fn a_settlement_sent_again_holds_the_units_used_a_window_from_its_first_try() {
    let mut events = requests(0, 3);
    events.push(Event::Advance { ms: 1000 });
    events.push(Event::Fault(Fault::NotApplied));
    events.push(Event::Sweep { instance: 0 });
    events.push(Event::Advance { ms: 2000 });
    events.push(Event::Sweep { instance: 0 });
    let (admitted, model) = run(&events).unwrap();
    assert_eq!((admitted, model.settlements), (3, 1));
    // Tried first at 1 s and sent again at 3 s: held until 1 s + the window (3 s), not 6 s.
    let ended_at = model.ended_at.unwrap();
    assert_eq!(
        model.held(ended_at),
        3,
        "the units used, still in their window"
    );
    let window_from_first_try = ended_at - Duration::from_secs(2) + WINDOW;
    assert_eq!(
        model.held(window_from_first_try),
        0,
        "not a window from the resend"
    );
}

/// [`with_a_first_lease`] and two more requests admitted from its lease: 3 units used.
fn with_three_units_used() -> (tokio::runtime::Runtime, ModelStore, Instance, CallerKey) {
    let (runtime, store, limiter, key) = with_a_first_lease();
    runtime.block_on(async {
        for _ in 0..2 {
            let decision = limiter.check(&key, NonZeroU64::MIN).await.unwrap();
            assert_eq!(decision.outcome, Outcome::Admitted);
        }
    });
    (runtime, store, limiter, key)
}

/// What the local view says account `id` has left now.
fn local_remaining(limiter: &Instance, store: &ModelStore, id: u128) -> u64 {
    let now = store.clock.now();
    limiter.local.quota(id, CAPACITY, now).remaining
}

/// A settlement whose outcome is unknown: the local view counts its lower bound (the units
/// used, as if it landed), neither the whole lease (which could refuse from memory what the
/// ledger admits) nor nothing. It forgot the caller, and with it what it had read of the
/// caller's credit: under the open policy with the ledger down, a caller it knew was spent was
/// then admitted, failed open, for as long as the outage lasted. The retry that settles it does
/// not count the units again.
#[test]
fn a_settlement_of_unknown_outcome_counts_the_units_used_once() {
    let (runtime, store, limiter, key) = with_three_units_used();
    let id = limiter.account_of(&key).unwrap();
    let remaining = || local_remaining(&limiter, &store, id);
    let first = super::LEASE_UNITS_FIRST;
    assert_eq!(remaining(), CAPACITY - first, "the lease counts whole");
    store.past_l();
    // Not applied: the retry settles it, and must not count its units a second time.
    store.next_call(Fault::NotApplied);
    runtime.block_on(limiter.settle_due_leases());
    assert_eq!(limiter.local_callers(), 1, "still known");
    assert_eq!(remaining(), CAPACITY - 3, "the units used");
    store
        .clock
        .advance_to(store.clock.now() + Duration::from_secs(1));
    runtime.block_on(limiter.settle_due_leases());
    assert_eq!(store.model.lock().unwrap().settlements, 1);
    assert_eq!(remaining(), CAPACITY - 3, "counted once");
}

/// A settlement sent again seconds after its first try (refused a place then) is counted by
/// the local view for a window from that first try, as the ledger holds it: counted for a window
/// from the resend, it outlived the ledger's hold, and refused from memory what the ledger
/// admits.
#[test]
fn a_settlement_sent_again_is_counted_as_long_as_the_ledger_holds_it() {
    let (runtime, store, limiter, key) = with_three_units_used();
    let id = limiter.account_of(&key).unwrap();
    let remaining = || local_remaining(&limiter, &store, id);
    store.past_l();
    let first_try = store.clock.now();
    store.model.lock().unwrap().overload_next_settlement = true;
    runtime.block_on(limiter.settle_due_leases());
    assert_eq!(
        store.model.lock().unwrap().settlements,
        0,
        "refused a place"
    );
    store.clock.advance_to(first_try + Duration::from_secs(2));
    runtime.block_on(limiter.settle_due_leases());
    assert_eq!(store.model.lock().unwrap().settlements, 1, "sent again");
    assert_eq!(remaining(), CAPACITY - 3, "the units used");
    // Past a window from the first try, and the margin: the ledger holds them no more.
    let margin = Duration::from_millis(250);
    store
        .clock
        .advance_to(first_try + WINDOW + margin + Duration::from_millis(10));
    let ledger_held = store.model.lock().unwrap().held(store.clock.now());
    assert_eq!(ledger_held, 0, "the ledger's hold ended");
    assert_eq!(remaining(), CAPACITY, "nor does the view count them");
}

/// A renewal ahead that finds no room for a lease (the view knows the caller's credit is all
/// held) takes none, and no other starts from the same lease: each admission from its second
/// half started one, each for nothing.
#[test]
fn a_renewal_ahead_without_room_is_not_asked_again_from_the_same_lease() {
    let (runtime, store, limiter, key) = with_a_first_lease();
    let one = NonZeroU64::MIN;
    let id = limiter.account_of(&key).unwrap();
    // What else the caller holds, as the view knows it: everything but the lease.
    let now = store.clock.now();
    let first = super::LEASE_UNITS_FIRST;
    limiter.local.record_hold(
        id,
        CAPACITY,
        CAPACITY - first,
        Roundtrip::at(now),
        WINDOW,
        now,
    );
    let mut renewals = 0;
    for _ in 2..=first {
        let (fast, due) = leased_from_memory(&limiter, &key, one).expect("room in the lease");
        assert_eq!(fast.outcome, Outcome::Admitted);
        if let Some(renewal) = due {
            renewals += 1;
            runtime.block_on(limiter.renew_lease_ahead(renewal));
        }
    }
    assert_eq!(renewals, 1, "one renewal ahead, which found no room");
}

/// An operator's act settles the leases that may predate it, not those sent since (stamped
/// after it, so judged by it): every lease went at each act anywhere, a top-up included, and
/// hot callers fell back to a ledger call per request.
#[test]
fn an_operator_act_settles_only_the_leases_sent_before_it_was_read() {
    let (runtime, store, limiter, key) = with_a_first_lease();
    let one = NonZeroU64::MIN;
    store
        .clock
        .advance_to(store.clock.now() + Duration::from_millis(1));
    let read_at = store.clock.now();
    let later = CallerKey::from_header_value("x-api-key", b"later", 64).unwrap();
    let first = runtime.block_on(limiter.check(&later, one)).unwrap();
    assert!(first.leased.is_some(), "a lease sent as the act was read");
    let settled = runtime.block_on(limiter.settle_leases_sent_before(Some(read_at)));
    assert_eq!(settled, 1, "the lease sent before");
    assert!(leased_from_memory(&limiter, &later, one).is_some(), "kept");
    assert!(leased_from_memory(&limiter, &key, one).is_none(), "settled");
}

/// An operator's act over more leases than one batch: those its pass did not take (a slow
/// ledger can end the pass at its deadline before it comes to them) admit no more from memory
/// meanwhile. Before, a lease sent before the act went on admitting, a blocked caller included,
/// until its renewal or the end of its L.
#[test]
fn leases_past_an_acts_batch_admit_no_more_meanwhile() {
    let (_runtime, store, limiter, key) = with_a_first_lease();
    let id = limiter.account_of(&key).unwrap();
    let first = limiter
        .leases
        .shard(id)
        .get(&id)
        .cloned()
        .expect("its slot");
    let (holder, lease) = {
        let caller = first.lock();
        (caller.holder, caller.lease.expect("its lease"))
    };
    // More callers with a lease as old (the model ledger keeps one caller's account).
    for other in 1..=(super::SETTLE_BATCH_MAX + 9) as u128 {
        let account_id = id.wrapping_add(other);
        let slot = super::Slot::new(super::Holder {
            account_id,
            ..holder
        });
        slot.lock().lease = Some(lease);
        limiter.leases.shard(account_id).insert(account_id, slot);
    }
    store
        .clock
        .advance_to(store.clock.now() + Duration::from_millis(1));
    let now = store.clock.now();
    let taken = limiter.leases.due(now, (Some(now), false));
    assert_eq!(taken.len(), super::SETTLE_BATCH_MAX, "one batch");
    let admitting = (limiter.leases.shards.iter())
        .flat_map(|shard| super::lock(shard).values().cloned().collect::<Vec<_>>())
        .filter(|slot| slot.lock().admit(1, (now, store.clock.wall())))
        .count();
    assert_eq!(admitting, 0, "none of the leases sent before the act");
    // The next sweep takes the rest as over.
    let rest = limiter.leases.due(now, (None, false));
    assert_eq!(rest.len(), 10);
}

/// A slot kept with no lease (a closed account's word, kept a minute) is swept every 100 ms:
/// its count of idle sweeps passed 255 in 26 s, a panic in the sweeper (debug builds). Only the
/// book holds the slot here: kept for the closed account's word alone, and counted.
#[test]
fn a_slot_kept_idle_for_minutes_is_swept_without_overflow() {
    let (_runtime, store, limiter, key) = with_a_first_lease();
    let id = limiter.account_of(&key).unwrap();
    let now = store.clock.now();
    let in_book = |limiter: &Instance| limiter.leases.shard(id).get(&id).cloned();
    {
        let slot = in_book(&limiter).expect("its slot");
        let mut caller = slot.lock();
        caller.lease = None;
        caller.closed_at = Some(now);
    }
    for _ in 0..300 {
        drop(limiter.leases.due(now, (None, false)));
    }
    let slot = in_book(&limiter).expect("kept for the closed account's word");
    assert_eq!(slot.lock().idle_sweeps, u8::MAX, "counted");
    drop(slot);
    // Once the word is old, forgotten.
    let later = now + super::CLOSED_WORD_KEPT;
    drop(limiter.leases.due(later, (None, false)));
    assert!(in_book(&limiter).is_none(), "forgotten");
}

/// A clean shutdown sends at once a settlement waiting to be sent again (its outcome unknown):
/// skipped, its lease held the unused units for window + L.
#[test]
fn a_clean_shutdown_sends_a_settlement_waiting_for_its_retry() {
    let (runtime, store, limiter, _key) = with_a_first_lease();
    store.past_l();
    store.next_call(Fault::NotApplied);
    runtime.block_on(limiter.settle_due_leases());
    assert_eq!(store.model.lock().unwrap().settlements, 0, "not applied");
    assert_eq!(runtime.block_on(limiter.settle_all_leases()), 1);
    let model = store.model.lock().unwrap();
    assert_eq!(model.settlements, 1);
    assert_eq!(model.held(store.clock.now()), 1, "the unit used");
}

/// A caller's lone request is decided per request: one transfer, where a lease took three (the
/// lease, its void and the hold of the unit used) and held the rest from every instance for L.
/// A second request within L takes the lease; a caller back after L shows its demand again.
#[test]
fn a_lease_waits_for_the_callers_demand() {
    let (runtime, store) = runtime_and_store();
    let limiter = gated_instance(&store, FailurePolicy::Closed, Duration::from_millis(500));
    let key = hot_key();
    let one = NonZeroU64::MIN;
    let lease_calls = || store.model.lock().unwrap().lease_calls;
    let lone = runtime.block_on(limiter.check(&key, one)).unwrap();
    assert_eq!(lone.outcome, Outcome::Admitted);
    assert!(lone.leased.is_none(), "decided per request");
    assert_eq!(lease_calls(), 0);
    let second = runtime.block_on(limiter.check(&key, one)).unwrap();
    assert!(second.leased.is_some(), "its demand seen: a lease");
    assert_eq!(lease_calls(), 1);
    // Back after the lease is over and settled: decided per request first, again.
    store.past_l();
    runtime.block_on(limiter.settle_due_leases());
    store.past_l();
    let back = runtime.block_on(limiter.check(&key, one)).unwrap();
    assert!(back.leased.is_none(), "decided per request");
    assert_eq!(lease_calls(), 1);
}

/// A renewal ahead held unrun (a library user's, or one at a slow ledger) does not keep the
/// sweeper from settling the lease when its time is over: skipped while a renewal was due, its
/// unused units stayed held from every instance past L.
#[test]
fn a_lease_over_is_settled_while_its_renewal_is_held() {
    let (runtime, store, limiter, key) = with_a_first_lease();
    let held = spend_the_first_lease(&limiter, &key);
    assert!(held.is_some(), "the renewal ahead, held unrun");
    store.past_l();
    assert_eq!(runtime.block_on(limiter.settle_due_leases()), 1);
    assert_eq!(store.model.lock().unwrap().settlements, 1);
    // The renewal, run late, takes the next lease as usual.
    runtime.block_on(limiter.renew_lease_ahead(held.unwrap()));
    assert!(leased_from_memory(&limiter, &key, NonZeroU64::MIN).is_some());
}

/// A renewal ahead its request holds unrun (a library user's, run after a slow handler): a
/// request that finds the lease spent waits for it half its time left at most, then is decided
/// per request. It went to the failure policy (here closed: a 503), the ledger healthy.
#[test]
fn a_request_waiting_on_a_renewal_held_unrun_is_decided_per_request() {
    let (runtime, _store, limiter, key) = with_a_first_lease();
    let one = NonZeroU64::MIN;
    let held = spend_the_first_lease(&limiter, &key);
    assert!(held.is_some(), "the renewal ahead, held unrun");
    let decision = runtime.block_on(limiter.check(&key, one)).unwrap();
    assert_eq!(
        decision.outcome,
        Outcome::Admitted,
        "{:?}",
        decision.outcome
    );
    assert!(decision.hold.is_some(), "per request");
    drop(held);
}

/// A renewal at the ledger is waited for until the deadline, not half of it: slow but
/// answering, it brings the lease sooner than a hold of the waiting request's own would land
/// (given up at half the time, every waiter became a ledger write, with half a deadline left).
#[test]
fn a_request_waits_for_a_renewal_at_the_ledger_past_half_its_time() {
    // Decisions of 2 s (real time: the waits are tokio's), so that "past half" and "before
    // the deadline" each have 400 ms to spare on a loaded machine.
    let (runtime, store) = runtime_and_store();
    let limiter = instance_timed(&store, FailurePolicy::Closed, Duration::from_secs(2));
    let key = hot_key();
    let first = runtime.block_on(limiter.check(&key, NonZeroU64::MIN));
    assert!(first.unwrap().leased.is_some(), "the first lease");
    let one = NonZeroU64::MIN;
    let due = spend_the_first_lease(&limiter, &key);
    let (answer, answered) = tokio::sync::oneshot::channel();
    store.model.lock().unwrap().answer_next_lease_on = Some(answered);
    let decision = runtime.block_on(async {
        // Deadlines from now, not from when the store was made.
        store.clock.advance_to(Instant::now());
        let renewing = limiter.renew_lease_ahead(due.expect("due at half the lease"));
        let waiting = async {
            tokio::time::sleep(Duration::from_millis(10)).await;
            limiter.check(&key, one).await.unwrap()
        };
        let answering = async {
            // Past half the request's time (1 s), well before its deadline (2 s).
            tokio::time::sleep(Duration::from_millis(1_400)).await;
            answer.send(()).unwrap();
        };
        tokio::join!(renewing, waiting, answering).1
    });
    assert_eq!(decision.outcome, Outcome::Admitted);
    assert!(
        decision.leased.is_some(),
        "from the renewed lease, not per request"
    );
}

/// Two leases of one caller whose settlements were refused a place before a sweep came: both
/// wait for it (a caller kept one, and the second was left to expire, its unused units held for
/// window + L).
#[test]
fn a_caller_hands_more_than_one_lease_over_to_the_sweeper() {
    let (runtime, store, limiter, key) = with_a_first_lease();
    let one = NonZeroU64::MIN;
    for _ in 0..CAPACITY {
        store.model.lock().unwrap().overload_next_settlement = true;
        let decision = runtime.block_on(limiter.check(&key, one)).unwrap();
        assert_eq!(decision.outcome, Outcome::Admitted);
        if store.model.lock().unwrap().leases == 3 {
            break;
        }
    }
    let model = store.model.lock().unwrap();
    assert_eq!(
        (model.leases, model.settlements),
        (3, 0),
        "two replaced, none settled"
    );
    drop(model);
    store.model.lock().unwrap().overload_next_settlement = false;
    runtime.block_on(limiter.settle_due_leases());
    assert_eq!(
        store.model.lock().unwrap().settlements,
        2,
        "both handed over"
    );
}
