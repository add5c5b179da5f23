//! Every branch of a decision, through the seams: a scripted [`Store`] and a manual [`Clock`].
//! The real-TigerBeetle tests (`tests/limiter.rs`) remain the proof of behaviour; these show that
//! each branch does what the architecture says, including the ones a real ledger rarely takes.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use super::*;
use crate::ledger::metrics::Operation;
use crate::ledger::{AccountFree, Blocked, ChainLink, ChainReply, Hold};
use plan::{test_plan, UnknownKeys};

#[path = "multi_tests.rs"]
mod multi;

type Reply<T> = Result<T, LedgerError>;

#[derive(Clone)]
struct ManualClock(Arc<Mutex<(Instant, SystemTime)>>);

impl ManualClock {
    fn new() -> Self {
        ManualClock(Arc::new(Mutex::new((Instant::now(), SystemTime::now()))))
    }

    fn advance(&self, by: Duration) {
        let mut now = self.0.lock().unwrap();
        now.0 += by;
        now.1 += by;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.0.lock().unwrap().0
    }

    fn wall(&self) -> SystemTime {
        self.0.lock().unwrap().1
    }
}

/// Answers from scripts, in order; records every call. An unscripted call fails the test.
#[derive(Default)]
struct Script {
    holds: VecDeque<Reply<HoldReply>>,
    provisions: VecDeque<Reply<()>>,
    views: VecDeque<Reply<Option<AccountView>>>,
    voids: VecDeque<Reply<bool>>,
    chains: VecDeque<Reply<ChainReply>>,
    /// The links of every chain asked for, in order.
    chain_links: Vec<Vec<ChainLink>>,
    calls: Vec<&'static str>,
    held_accounts: Vec<u128>,
    void_if_abandoned: Vec<bool>,
    errors_recorded: usize,
    published_at_scrape: usize,
    /// The deadline of every void asked for, in order.
    void_deadlines: Vec<Instant>,
    /// When set, a void is sent and never answered.
    void_stalls: bool,
    /// When set, the next account read says it is reading, then waits for the go-ahead: what
    /// happens meanwhile happens while the read is at the ledger.
    view_gate: Option<(
        tokio::sync::oneshot::Sender<()>,
        tokio::sync::oneshot::Receiver<()>,
    )>,
}

struct FakeStore(Mutex<Script>);

impl FakeStore {
    fn next<T>(&self, call: &'static str, pick: impl FnOnce(&mut Script) -> Option<T>) -> T {
        let mut script = self.0.lock().unwrap();
        script.calls.push(call);
        pick(&mut script).unwrap_or_else(|| panic!("unscripted {call}"))
    }
}

impl Store for FakeStore {
    fn ledger_id(&self) -> u32 {
        model::LEDGER_REQUEST_RATE
    }

    async fn hold(&self, id: u128, _: u64, _: u32, _: Instant, void: bool) -> Reply<HoldReply> {
        self.0.lock().unwrap().void_if_abandoned.push(void);
        self.0.lock().unwrap().held_accounts.push(id);
        self.next("hold", |s| s.holds.pop_front())
    }

    async fn hold_chain(&self, links: Vec<ChainLink>, _: Instant, void: bool) -> Reply<ChainReply> {
        let mut script = self.0.lock().unwrap();
        script.void_if_abandoned.push(void);
        script.chain_links.push(links);
        drop(script);
        self.next("chain", |s| s.chains.pop_front())
    }

    async fn void(&self, _: u128, deadline: Instant) -> Reply<bool> {
        let stalls = {
            let mut script = self.0.lock().unwrap();
            script.void_deadlines.push(deadline);
            script.void_stalls
        };
        if stalls {
            self.0.lock().unwrap().calls.push("void");
            return std::future::pending().await;
        }
        self.next("void", |s| s.voids.pop_front())
    }

    async fn provision(&self, _: &UserAccount, _: Instant) -> Reply<()> {
        self.next("provision", |s| s.provisions.pop_front())
    }

    async fn account_view(&self, _: u128, _: u32, _: Instant) -> Reply<Option<AccountView>> {
        let gate = self.0.lock().unwrap().view_gate.take();
        if let Some((reading, go)) = gate {
            reading.send(()).unwrap();
            go.await.unwrap();
        }
        self.next("view", |s| s.views.pop_front())
    }

    /// A lookup alone: the next scripted view, as a lookup has it.
    async fn account_free(&self, _: u128, _: u32, _: Instant) -> Reply<Option<AccountFree>> {
        let view = self.next("free", |s| s.views.pop_front())?;
        Ok(view.as_ref().map(AccountFree::from))
    }

    async fn ping(&self, _: Instant) -> Reply<()> {
        Ok(())
    }

    fn record_error(&self, _: &LedgerError) {
        self.0.lock().unwrap().errors_recorded += 1;
    }

    fn publish_at_scrape(&self) {
        self.0.lock().unwrap().published_at_scrape += 1;
    }
}

const CAPACITY: u64 = 5;
const WINDOW: Duration = Duration::from_secs(30);
const ONE: NonZeroU64 = NonZeroU64::MIN;

struct Fixture {
    limiter: Limiter<FakeStore, ManualClock>,
    clock: ManualClock,
}

impl Fixture {
    fn new(policy: FailurePolicy, unknown_keys: UnknownKeys) -> Self {
        let plans = PlanBook::new(
            vec![test_plan("free", CAPACITY), test_plan("pro", 2 * CAPACITY)],
            "free",
            [("listed_".to_owned(), "free".to_owned())],
            [],
            unknown_keys,
        )
        .unwrap();
        let settings = LimiterSettings {
            ledger_timeout: Duration::from_millis(500),
            failure_policy: policy,
            local_callers_max: 100,
            expiry_margin: Duration::ZERO,
        };
        let clock = ManualClock::new();
        let store = FakeStore(Mutex::new(Script::default()));
        let limiter = Limiter::with_seams(store, clock.clone(), Arc::new(plans), settings);
        Fixture { limiter, clock }
    }

    fn closed() -> Self {
        Self::new(FailurePolicy::Closed, UnknownKeys::DefaultPlan)
    }

    /// [`Fixture::closed`] with a local view of `callers_max` callers (0: off).
    fn with_view(callers_max: usize) -> Self {
        let mut f = Self::closed();
        let settings = LimiterSettings {
            local_callers_max: callers_max,
            ..f.limiter.settings().clone()
        };
        let plans = Arc::new(f.limiter.plans().clone());
        let store = FakeStore(Mutex::new(Script::default()));
        f.limiter = Limiter::with_seams(store, f.clock.clone(), plans, settings);
        f
    }

    fn script(&self, edit: impl FnOnce(&mut Script)) {
        edit(&mut self.limiter.store.0.lock().unwrap());
    }

    fn calls(&self) -> Vec<&'static str> {
        std::mem::take(&mut self.limiter.store.0.lock().unwrap().calls)
    }

    fn held(&self) -> Reply<HoldReply> {
        Ok(HoldReply::Held {
            roundtrip: Roundtrip::at(self.clock.now()),
            transfer_id: 42,
        })
    }

    /// The ledger's account: `credit`, and holds of 1 expiring after each of `expiries_s`.
    fn view(&self, credit: u64, expiries_s: &[u64], complete: bool) -> AccountView {
        let wall = self.clock.wall();
        let holds: Vec<Hold> = expiries_s
            .iter()
            .enumerate()
            .map(|(id, s)| Hold {
                id: id as u128,
                amount: 1,
                expires_at: wall + Duration::from_secs(*s),
                leased_at: None,
            })
            .collect();
        AccountView {
            credit,
            granted: credit > 0,
            available: credit.saturating_sub(if complete { holds.len() as u64 } else { credit }),
            holds,
            complete,
            blocked: None,
        }
    }

    /// [`Fixture::check`] of one unit, with `change` made while its account is read (the
    /// scripted read waits for it).
    async fn check_while_read(&self, change: impl FnOnce()) -> Decision<'_> {
        let (reading, read_started) = tokio::sync::oneshot::channel();
        let (go, gate) = tokio::sync::oneshot::channel();
        self.script(|s| s.view_gate = Some((reading, gate)));
        let changing = async {
            read_started.await.expect("the decision reads the account");
            change();
            go.send(()).unwrap();
        };
        // Bounded: a decision that never reads the account fails the test instead of hanging it.
        let both = async { tokio::join!(self.check(ONE), changing).0 };
        tokio::time::timeout(Duration::from_secs(10), both)
            .await
            .expect("the decision reads the account, and is answered")
    }

    /// Scripts the next decision's ledger: the hold refused (the account closed), and the
    /// account's listing, blocked for a week.
    fn script_blocked_for_a_week(&self) {
        let blocked = AccountView {
            blocked: Some(Blocked {
                until: Some(self.clock.wall() + Duration::from_secs(7 * 24 * 3600)),
                moved_to: None,
            }),
            ..self.view(CAPACITY, &[], true)
        };
        self.script(|s| {
            s.holds.push_back(Ok(HoldReply::Blocked));
            s.views.push_back(Ok(Some(blocked)));
        });
    }

    async fn check(&self, cost: NonZeroU64) -> Decision<'_> {
        let key = CallerKey::from_header_value("x-api-key", b"k", 64).unwrap();
        self.limiter.check(&key, cost).await.expect("a known key")
    }
}

fn timeout() -> LedgerError {
    LedgerError::Timeout {
        operation: Operation::CreateTransfers,
    }
}

fn limited_by(decision: &Decision) -> Option<(u64, DecisionSource)> {
    match decision.outcome {
        Outcome::Limited {
            retry_after_seconds,
            source,
        } => Some((retry_after_seconds, source)),
        _ => None,
    }
}

#[tokio::test]
async fn a_known_caller_costs_one_hold() {
    let f = Fixture::closed();
    let held = f.held();
    f.script(|s| s.holds.push_back(held));
    let decision = f.check(ONE).await;
    assert_eq!(decision.outcome, Outcome::Admitted);
    assert_eq!(decision.quota.remaining, CAPACITY - 1);
    assert_eq!(decision.quota.reset_seconds, WINDOW.as_secs());
    assert_eq!(decision.plan.name(), "free");
    assert_eq!(f.calls(), ["hold"]);
    // Fail closed: a hold that lands after its request was refused must be voided.
    f.script(|s| assert_eq!(s.void_if_abandoned, [true]));
}

#[tokio::test]
async fn an_exhausted_caller_is_refused_locally_on_the_ledgers_word() {
    let f = Fixture::closed();
    for _ in 0..CAPACITY {
        let held = f.held();
        f.script(|s| s.holds.push_back(held));
        assert_eq!(f.check(ONE).await.outcome, Outcome::Admitted);
    }
    f.calls();
    let full = f.view(CAPACITY, &[WINDOW.as_secs(); CAPACITY as usize], true);
    f.script(|s| {
        s.holds.push_back(Ok(HoldReply::ExceedsCredits));
        s.views.push_back(Ok(Some(full.clone())));
    });
    let refused = f.check(ONE).await;
    assert_eq!(
        limited_by(&refused),
        Some((WINDOW.as_secs(), DecisionSource::Ledger))
    );
    assert_eq!(f.calls(), ["hold", "view"]);
    let refused = f.check(ONE).await;
    assert_eq!(
        limited_by(&refused),
        Some((WINDOW.as_secs(), DecisionSource::LocalView))
    );
    assert_eq!(refused.quota.remaining, 0);
    assert!(f.calls().is_empty(), "a local refusal makes no ledger call");
    // Until the holds expire (or an operator acts somewhere): then the ledger decides again.
    f.clock.advance(WINDOW);
    let held = f.held();
    f.script(|s| s.holds.push_back(held));
    assert_eq!(f.check(ONE).await.outcome, Outcome::Admitted);
    assert_eq!(f.calls(), ["hold"]);
}

/// [`Limiter::from_memory`]'s refusal for one unit (a per-request plan never leases).
fn refused_from_memory<'a, S: Store, C: Clock>(
    limiter: &'a Limiter<S, C>,
    key: &CallerKey,
) -> Option<Decision<'a>> {
    match limiter.from_memory(key, ONE, true)? {
        FromMemory::Refused(decision) => Some(decision),
        FromMemory::Leased(..) => panic!("a per-request plan admitted from a lease"),
    }
}

/// The middleware answers a refusal from memory without the async path: it must be the very
/// decision `check` would have made, and come only when memory alone decides.
#[tokio::test]
async fn memory_alone_refuses_exactly_what_check_refuses_locally() {
    let f = Fixture::closed();
    let key = CallerKey::from_header_value("x-api-key", b"k", 64).unwrap();
    assert!(
        refused_from_memory(&f.limiter, &key).is_none(),
        "a new caller"
    );
    for _ in 0..CAPACITY {
        let held = f.held();
        f.script(|s| s.holds.push_back(held));
        assert_eq!(f.check(ONE).await.outcome, Outcome::Admitted);
        assert!(
            refused_from_memory(&f.limiter, &key).is_none(),
            "not yet the ledger's word"
        );
    }
    let full = f.view(CAPACITY, &[WINDOW.as_secs(); CAPACITY as usize], true);
    f.script(|s| {
        s.holds.push_back(Ok(HoldReply::ExceedsCredits));
        s.views.push_back(Ok(Some(full.clone())));
    });
    assert!(limited_by(&f.check(ONE).await).is_some());
    f.calls();
    let fast = refused_from_memory(&f.limiter, &key).expect("refused from memory");
    let slow = f.check(ONE).await;
    assert_eq!(fast.outcome, slow.outcome);
    assert_eq!(
        limited_by(&fast),
        Some((WINDOW.as_secs(), DecisionSource::LocalView))
    );
    assert_eq!(fast.quota, slow.quota);
    assert_eq!(
        (fast.account_id, fast.plan_id),
        (slow.account_id, slow.plan_id)
    );
    assert!(fast.hold.is_none() && fast.leased.is_none());
    assert!(f.calls().is_empty(), "no ledger call either way");
    // A caller whose holds expired is the ledger's to decide. (A key without a plan never has
    // an account for memory to know: `from_memory` leaves it to `check`, which rejects it.)
    f.clock.advance(WINDOW);
    assert!(refused_from_memory(&f.limiter, &key).is_none());
    assert!(f.calls().is_empty());
}

#[tokio::test]
async fn a_blocked_caller_is_refused_until_the_block_ends() {
    let f = Fixture::closed();
    let block = Duration::from_secs(90);
    let blocked = AccountView {
        blocked: Some(Blocked {
            until: Some(f.clock.wall() + block),
            moved_to: None,
        }),
        ..f.view(CAPACITY, &[], true)
    };
    f.script(|s| {
        s.holds.push_back(Ok(HoldReply::Blocked));
        s.views.push_back(Ok(Some(blocked)));
    });
    let refused = f.check(ONE).await;
    // The fixture's expiry margin is zero.
    let expected = block;
    assert_eq!(
        refused.outcome,
        Outcome::Blocked {
            retry_after_seconds: expected.as_secs(),
            source: DecisionSource::Ledger
        }
    );
    // Nothing to spend, and the quota back when the block ends, as Retry-After says.
    assert_eq!(refused.quota.remaining, 0);
    assert_eq!(refused.quota.reset_seconds, block.as_secs());
    assert_eq!(f.calls(), ["hold", "view"]);
    let again = f.check(ONE).await;
    assert!(matches!(
        again.outcome,
        Outcome::Blocked {
            source: DecisionSource::LocalView,
            ..
        }
    ));
    assert_eq!(again.quota.reset_seconds, block.as_secs());
    assert!(f.calls().is_empty());
}

/// A caller read blocked (fail-open), then `between`, then a hold the ledger does not answer: the
/// request's outcome, once the ledger was asked again.
async fn blocked_then_the_ledger_fails(between: impl FnOnce(&Fixture)) -> Outcome {
    let f = Fixture::new(FailurePolicy::Open, UnknownKeys::DefaultPlan);
    f.script_blocked_for_a_week();
    assert!(matches!(
        f.check(ONE).await.outcome,
        Outcome::Blocked { .. }
    ));
    f.calls();
    between(&f);
    f.script(|s| s.holds.push_back(Err(timeout())));
    let failed = f.check(ONE).await;
    assert_eq!(f.calls(), ["hold"], "the ledger was asked again");
    failed.outcome
}

/// A block is refused from memory for a minute, then the ledger decides again (an unblock this
/// instance missed ends there); but when the ledger cannot be asked, the block it last said
/// stands, whatever the failure policy: an operator's block is never failed open.
#[tokio::test]
async fn a_block_read_a_minute_ago_is_asked_again_and_stands_when_the_ledger_fails() {
    let later = |f: &Fixture| f.clock.advance(Duration::from_secs(61));
    let outcome = blocked_then_the_ledger_fails(later).await;
    let from_memory = matches!(
        outcome,
        Outcome::Blocked {
            source: DecisionSource::LocalView,
            ..
        }
    );
    assert!(from_memory, "{outcome:?}");
}

/// An operator acts on anyone, anywhere: the epoch follower clears every instance's view. A
/// block read before stands all the same when the ledger then cannot be asked (it was dropped
/// with the view, and fail-open admitted the blocked caller).
#[tokio::test]
async fn a_block_read_before_any_operators_act_stands_when_the_ledger_fails() {
    let cleared = |f: &Fixture| f.limiter.forget_all_local();
    let outcome = blocked_then_the_ledger_fails(cleared).await;
    assert!(matches!(outcome, Outcome::Blocked { .. }), "{outcome:?}");
}

#[tokio::test]
async fn an_unblock_while_the_blocked_account_is_read_is_not_undone_by_the_read() {
    let f = Fixture::closed();
    f.script_blocked_for_a_week();
    // An operator unblocks the caller while its account is read: the epoch follower clears
    // this instance's view before the read's answer (still blocked) arrives.
    let refused = f.check_while_read(|| f.limiter.forget_all_local()).await;
    assert!(matches!(refused.outcome, Outcome::Blocked { .. }));
    assert_eq!(f.calls(), ["hold", "view"]);
    // The next request asks the ledger, which admits it, rather than a memory of the block.
    let held = f.held();
    f.script(|s| s.holds.push_back(held));
    assert_eq!(f.check(ONE).await.outcome, Outcome::Admitted);
    assert_eq!(f.calls(), ["hold"]);
}

/// The listing of a refusal answers that refusal (`Retry-After`, the quota) whether or not it
/// may be stored; a change elsewhere (another shard's forget: Envoy's routine releases) keeps it
/// from being stored no more, and one in its shard only from being stored.
#[tokio::test]
async fn a_refusals_listing_answers_it_though_a_change_keeps_it_from_being_stored() {
    let f = Fixture::closed();
    let key = CallerKey::from_header_value("x-api-key", b"k", 64).unwrap();
    let id = f.limiter.account_of(&key).unwrap();
    for (other, stored) in [(id + 1, true), (id + 64, false)] {
        f.limiter.forget_local(id);
        let full = f.view(CAPACITY, &[20; 5], true);
        f.script(|s| {
            s.holds.push_back(Ok(HoldReply::ExceedsCredits));
            s.views.push_back(Ok(Some(full)));
        });
        let refused = f.check_while_read(|| f.limiter.forget_local(other)).await;
        assert_eq!(limited_by(&refused), Some((20, DecisionSource::Ledger)));
        assert_eq!(refused.quota.remaining, 0);
        assert_eq!(refused.quota.reset_seconds, 20);
        assert_eq!(f.calls(), ["hold", "view"]);
        if !stored {
            // Not stored: the next request asks the ledger again.
            let full = f.view(CAPACITY, &[20; 5], true);
            f.script(|s| {
                s.holds.push_back(Ok(HoldReply::ExceedsCredits));
                s.views.push_back(Ok(Some(full)));
            });
        }
        let again = f.check(ONE).await;
        match stored {
            true => {
                assert_eq!(limited_by(&again), Some((20, DecisionSource::LocalView)));
                assert!(f.calls().is_empty(), "refused from memory");
            }
            false => {
                assert_eq!(limited_by(&again), Some((20, DecisionSource::Ledger)));
                assert_eq!(f.calls(), ["hold", "view"]);
            }
        }
    }
}

#[tokio::test]
async fn a_new_caller_is_provisioned_then_held() {
    let f = Fixture::closed();
    let held = f.held();
    f.script(|s| {
        s.holds.extend([Ok(HoldReply::AccountNotFound), held]);
        s.provisions.push_back(Ok(()));
    });
    assert_eq!(f.check(ONE).await.outcome, Outcome::Admitted);
    assert_eq!(f.calls(), ["hold", "provision", "hold"]);
}

#[tokio::test]
async fn an_account_missing_right_after_provisioning_is_an_unexpected_error() {
    let f = Fixture::closed();
    f.script(|s| {
        s.holds.extend([
            Ok(HoldReply::AccountNotFound),
            Ok(HoldReply::AccountNotFound),
        ]);
        s.provisions.push_back(Ok(()));
    });
    let decision = f.check(ONE).await;
    assert!(
        matches!(
            decision.outcome,
            Outcome::FailedClosed(LedgerError::Unexpected { .. })
        ),
        "{decision:?}"
    );
    assert_eq!(f.calls(), ["hold", "provision", "hold"]);
    f.script(|s| assert_eq!(s.errors_recorded, 1));
}

#[tokio::test]
async fn a_failed_provisioning_follows_the_failure_policy() {
    let f = Fixture::new(FailurePolicy::Open, UnknownKeys::DefaultPlan);
    f.script(|s| {
        s.holds.push_back(Ok(HoldReply::AccountNotFound));
        s.provisions.push_back(Err(timeout()));
    });
    let decision = f.check(ONE).await;
    assert_eq!(decision.outcome, Outcome::FailedOpen(timeout()));
    // The fields still tell the caller its quota (nothing known: all of it).
    assert_eq!(decision.quota.remaining, CAPACITY);
    f.script(|s| assert_eq!(s.void_if_abandoned, [false]));
}

#[tokio::test]
async fn a_new_caller_race_finishes_provisioning_and_holds_again() {
    let f = Fixture::closed();
    let held = f.held();
    let ungranted = f.view(0, &[], true);
    f.script(|s| {
        s.holds.extend([Ok(HoldReply::ExceedsCredits), held]);
        s.views.push_back(Ok(Some(ungranted)));
        s.provisions.push_back(Ok(()));
    });
    assert_eq!(f.check(ONE).await.outcome, Outcome::Admitted);
    assert_eq!(f.calls(), ["hold", "view", "provision", "hold"]);
}

#[tokio::test]
async fn finishing_a_racing_provisioning_can_fail() {
    let f = Fixture::closed();
    let ungranted = f.view(0, &[], true);
    f.script(|s| {
        s.holds.push_back(Ok(HoldReply::ExceedsCredits));
        s.views.push_back(Ok(Some(ungranted)));
        s.provisions.push_back(Err(timeout()));
    });
    assert_eq!(f.check(ONE).await.outcome, Outcome::FailedClosed(timeout()));
    assert_eq!(f.calls(), ["hold", "view", "provision"]);
}

#[tokio::test]
async fn credit_back_between_the_two_calls_is_held_again() {
    let f = Fixture::closed();
    let held = f.held();
    let freed = f.view(CAPACITY, &[10, 20], true);
    f.script(|s| {
        s.holds.extend([Ok(HoldReply::ExceedsCredits), held]);
        s.views.push_back(Ok(Some(freed)));
    });
    assert_eq!(f.check(ONE).await.outcome, Outcome::Admitted);
    assert_eq!(f.calls(), ["hold", "view", "hold"]);
}

#[tokio::test]
async fn a_second_refusal_is_a_429_timed_by_the_listed_holds() {
    let f = Fixture::closed();
    let freed = f.view(CAPACITY, &[10], true);
    let full = f.view(CAPACITY, &[7, 8, 9, 10, 12], true);
    f.script(|s| {
        s.holds
            .extend([Ok(HoldReply::ExceedsCredits), Ok(HoldReply::ExceedsCredits)]);
        s.views.extend([Ok(Some(freed)), Ok(Some(full))]);
    });
    let decision = f.check(ONE).await;
    assert_eq!(limited_by(&decision), Some((7, DecisionSource::Ledger)));
    assert_eq!(decision.quota.remaining, 0);
    // When the first hold is released, as its Retry-After says (not when all are, at 12 s).
    assert_eq!(decision.quota.reset_seconds, 7);
    assert_eq!(f.calls(), ["hold", "view", "hold", "view"]);
    // Remembered: the next request is refused without a call.
    assert_eq!(
        limited_by(&f.check(ONE).await),
        Some((7, DecisionSource::LocalView))
    );
    assert!(f.calls().is_empty());
}

#[tokio::test]
async fn retry_after_waits_for_enough_credit_for_the_cost() {
    let f = Fixture::closed();
    let full = f.view(CAPACITY, &[3, 4, 5, 6, 7], true);
    f.script(|s| {
        s.holds.push_back(Ok(HoldReply::ExceedsCredits));
        s.views.push_back(Ok(Some(full)));
    });
    let three = NonZeroU64::new(3).unwrap();
    assert_eq!(
        limited_by(&f.check(three).await),
        Some((5, DecisionSource::Ledger))
    );
    // Two of five left: too few for three, and said as they are (a local refusal says the same).
    let f = Fixture::closed();
    let partly = f.view(CAPACITY, &[3, 4, 5], true);
    f.script(|s| {
        s.holds.push_back(Ok(HoldReply::ExceedsCredits));
        s.views.push_back(Ok(Some(partly)));
    });
    let refused = f.check(three).await;
    assert_eq!(limited_by(&refused), Some((3, DecisionSource::Ledger)));
    assert_eq!(refused.quota.remaining, 2);
    let again = f.check(three).await;
    assert_eq!(limited_by(&again), Some((3, DecisionSource::LocalView)));
    assert_eq!(again.quota.remaining, 2);
}

#[tokio::test]
async fn a_topped_up_caller_never_shows_more_remaining_than_its_limit() {
    let f = Fixture::closed();
    // Credit 3 × capacity (an operator's top-up), 14 held: the ledger refuses a cost of 2.
    let topped_up = f.view(3 * CAPACITY, &[10; 14], true);
    f.script(|s| {
        s.holds.push_back(Ok(HoldReply::ExceedsCredits));
        s.views.push_back(Ok(Some(topped_up)));
    });
    let two = NonZeroU64::new(2).unwrap();
    assert!(limited_by(&f.check(two).await).is_some());
    // Ten seconds on, the 14 are gone: 15 free, but the fields show the plan's 5 at most.
    f.clock.advance(Duration::from_secs(10));
    let held = f.held();
    f.script(|s| s.holds.push_back(held));
    let admitted = f.check(ONE).await;
    assert_eq!(admitted.outcome, Outcome::Admitted);
    assert_eq!(admitted.quota.limit, CAPACITY);
    assert_eq!(admitted.quota.remaining, CAPACITY);
}

#[tokio::test]
async fn without_a_view_retry_after_is_the_callers_window() {
    for view in [Err(timeout()), Ok(None)] {
        let f = Fixture::closed();
        f.script(|s| {
            s.holds.push_back(Ok(HoldReply::ExceedsCredits));
            s.views.push_back(view);
        });
        let decision = f.check(ONE).await;
        assert_eq!(
            limited_by(&decision),
            Some((WINDOW.as_secs(), DecisionSource::Ledger))
        );
        assert_eq!(f.calls(), ["hold", "view"]);
        // The quota's reset is no sooner than the retry: `t=0` beside `Retry-After` of a
        // window would tell the caller its quota is whole now.
        assert!(
            decision.quota.reset_seconds >= WINDOW.as_secs(),
            "{decision:?}"
        );
    }
}

/// A refusal that this instance's view could not keep (it is full, or off) reads the account
/// with one lookup, not a listing of its holds (up to 16 pages more), which was paid again on
/// every refused request: refused for the shortest `Retry-After`, nothing remembered.
#[tokio::test]
async fn a_refusal_the_view_cannot_keep_is_read_with_one_lookup() {
    let f = Fixture::with_view(0);
    for _ in 0..2 {
        let spent = f.view(2, &[20, 30], true);
        f.script(|s| {
            s.holds.push_back(Ok(HoldReply::ExceedsCredits));
            s.views.push_back(Ok(Some(spent)));
        });
        let decision = f.check(ONE).await;
        assert_eq!(limited_by(&decision), Some((1, DecisionSource::Ledger)));
        assert_eq!(decision.quota.remaining, 0);
        assert_eq!(f.calls(), ["hold", "free"], "a lookup, no listing");
    }
}

#[tokio::test]
async fn an_incomplete_listing_counts_only_the_listed_holds() {
    let f = Fixture::closed();
    // Five held, two listed (expiring in 1 s); three not listed: the oldest (the listing is
    // newest first), which may expire any moment, so the view does not count them.
    let partial = f.view(CAPACITY, &[1, 1], false);
    f.script(|s| {
        s.holds.push_back(Ok(HoldReply::ExceedsCredits));
        s.views.push_back(Ok(Some(partial)));
    });
    let three = NonZeroU64::new(3).unwrap();
    // The ledger refused; the view cannot tell when credit returns: the shortest Retry-After.
    assert_eq!(
        limited_by(&f.check(three).await),
        Some((1, DecisionSource::Ledger))
    );
    // Locally, only what the two listed holds rule out is refused: four units, for 1 s.
    let four = NonZeroU64::new(4).unwrap();
    assert_eq!(
        limited_by(&f.check(four).await),
        Some((1, DecisionSource::LocalView))
    );
}

/// A caller holding more than a listing reads, refused by the ledger again within a second of
/// its last listing: that listing stands (the same `Retry-After`, 1 s), and the account is
/// not listed again: one ledger call for the refusal, not up to 18. A second later it is.
#[tokio::test]
async fn a_listing_that_missed_holds_stands_for_a_second() {
    let f = Fixture::closed();
    let partial = || f.view(CAPACITY, &[20, 20], false);
    f.script(|s| {
        s.holds.push_back(Ok(HoldReply::ExceedsCredits));
        s.views.push_back(Ok(Some(partial())));
    });
    assert_eq!(
        limited_by(&f.check(ONE).await),
        Some((1, DecisionSource::Ledger))
    );
    assert_eq!(f.calls(), ["hold", "view"]);
    f.clock.advance(Duration::from_millis(900));
    f.script(|s| s.holds.push_back(Ok(HoldReply::ExceedsCredits)));
    let again = f.check(ONE).await;
    assert_eq!(limited_by(&again), Some((1, DecisionSource::Ledger)));
    assert_eq!(again.quota.remaining, 0, "{:?}", again.quota);
    assert_eq!(f.calls(), ["hold"], "not listed again");
    f.clock.advance(Duration::from_millis(200));
    f.script(|s| {
        s.holds.push_back(Ok(HoldReply::ExceedsCredits));
        s.views.push_back(Ok(Some(partial())));
    });
    assert_eq!(
        limited_by(&f.check(ONE).await),
        Some((1, DecisionSource::Ledger))
    );
    assert_eq!(f.calls(), ["hold", "view"], "listed again after a second");
}

/// Refusals on a listing that missed holds, whose listed holds have all ended (here it listed
/// none): `t` (the quota's reset) is never sooner than `Retry-After` (it said `t=0` beside
/// `Retry-After: 1` once the listing's holds were gone).
#[tokio::test]
async fn a_listing_that_missed_holds_resets_no_sooner_than_it_retries() {
    let f = Fixture::closed();
    f.script(|s| {
        s.holds.push_back(Ok(HoldReply::ExceedsCredits));
        s.views.push_back(Ok(Some(f.view(CAPACITY, &[], false))));
    });
    let first = f.check(ONE).await;
    assert_eq!(limited_by(&first), Some((1, DecisionSource::Ledger)));
    assert!(first.quota.reset_seconds >= 1, "{:?}", first.quota);
    f.clock.advance(Duration::from_millis(900));
    f.script(|s| s.holds.push_back(Ok(HoldReply::ExceedsCredits)));
    let again = f.check(ONE).await;
    assert_eq!(limited_by(&again), Some((1, DecisionSource::Ledger)));
    assert_eq!(f.calls(), ["hold", "view", "hold"], "refused as listed");
    assert!(again.quota.reset_seconds >= 1, "{:?}", again.quota);
}

#[tokio::test]
async fn ledger_errors_follow_the_failure_policy() {
    for (policy, void) in [(FailurePolicy::Closed, true), (FailurePolicy::Open, false)] {
        let f = Fixture::new(policy, UnknownKeys::DefaultPlan);
        f.script(|s| s.holds.push_back(Err(timeout())));
        let outcome = f.check(ONE).await.outcome;
        let expected = match policy {
            FailurePolicy::Closed => Outcome::FailedClosed(timeout()),
            FailurePolicy::Open => Outcome::FailedOpen(timeout()),
        };
        assert_eq!(outcome, expected);
        f.script(|s| assert_eq!(s.void_if_abandoned, [void]));
    }
}

#[tokio::test]
async fn an_unknown_key_is_rejected_without_a_ledger_call() {
    let f = Fixture::new(FailurePolicy::Closed, UnknownKeys::Reject);
    let stranger = CallerKey::from_header_value("x-api-key", b"stranger", 64).unwrap();
    assert_eq!(
        f.limiter.check(&stranger, ONE).await,
        Err(KeyError::Unknown)
    );
    assert!(f.calls().is_empty());
    let held = f.held();
    f.script(|s| s.holds.push_back(held));
    let listed = CallerKey::from_header_value("x-api-key", b"listed_1", 64).unwrap();
    assert!(f.limiter.check(&listed, ONE).await.is_ok());
}

#[tokio::test]
async fn a_refund_voids_the_hold_and_gives_the_credit_back_locally() {
    let f = Fixture::closed();
    let held = f.held();
    f.script(|s| {
        s.holds.push_back(held);
        s.voids.push_back(Ok(true));
    });
    let key = CallerKey::from_header_value("x-api-key", b"k", 64).unwrap();
    let mut decision = f.limiter.check(&key, ONE).await.unwrap();
    assert_eq!(decision.hold.map(|h| h.transfer_id), Some(42));
    assert_eq!(decision.quota.remaining, CAPACITY - 1);
    assert_eq!(f.limiter.refund(&mut decision).await, Ok(true));
    assert_eq!(f.calls(), ["hold", "void"]);
    // Given back, not forgotten (a forgotten caller's next hold reads the same quota).
    assert_eq!(f.limiter.local_callers(), 1, "still known");
    // This instance knows the credit is back: the next request sees the whole quota again.
    let held = f.held();
    f.script(|s| s.holds.push_back(held));
    assert_eq!(f.check(ONE).await.quota.remaining, CAPACITY - 1);
}

/// The first of a caller's `CAPACITY` requests, admitted, once the others were admitted too (all
/// their holds answered now): the decision a slow request has when it comes to give back.
async fn first_of_a_whole_quota(f: &Fixture) -> Decision<'_> {
    let answered_at = f.clock.now();
    f.script(|s| {
        for id in 0..CAPACITY {
            let transfer_id = 100 + u128::from(id);
            let held = HoldReply::Held {
                roundtrip: Roundtrip::at(answered_at),
                transfer_id,
            };
            s.holds.push_back(Ok(held));
        }
    });
    let key = CallerKey::from_header_value("x-api-key", b"k", 64).unwrap();
    let slow = f.limiter.check(&key, ONE).await.unwrap();
    for _ in 1..CAPACITY {
        let other = f.limiter.check(&key, ONE).await.unwrap();
        assert_eq!(other.outcome, Outcome::Admitted);
    }
    slow
}

/// A refund's fields count what the caller's other requests took while it ran: they said the
/// whole quota was back (`r=5;t=0`) while the others held all but the unit it gave back.
#[tokio::test]
async fn a_refunds_fields_count_what_was_admitted_meanwhile() {
    let f = Fixture::closed();
    f.script(|s| s.voids.push_back(Ok(true)));
    let mut slow = first_of_a_whole_quota(&f).await;
    assert_eq!(f.limiter.refund(&mut slow).await, Ok(true));
    assert_eq!(slow.quota.remaining, 1);
    assert_eq!(slow.quota.reset_seconds, WINDOW.as_secs());
}

/// A give-back after the answer (a request refused a concurrency slot) counts what the caller's
/// other requests took while it waited, as a refund does: its 429 said `r=5;t=0` while the
/// others held all but the unit it gave back.
#[tokio::test]
async fn a_give_back_laters_fields_count_what_was_admitted_meanwhile() {
    let f = Fixture::closed();
    let mut slow = first_of_a_whole_quota(&f).await;
    let holds = f.limiter.give_back_later(&mut slow);
    assert!(holds.is_some(), "its hold, to void");
    assert_eq!(slow.quota.remaining, 1);
    assert_eq!(slow.quota.reset_seconds, WINDOW.as_secs());
    assert!(
        slow.hold.is_none(),
        "taken out: a refund of it finds nothing"
    );
}

/// The plan's hold expired (a short window), a route limit's had not (a day's): the refund gave
/// that back, and said it gave nothing, so it went uncounted.
#[tokio::test]
async fn a_refund_of_a_route_limits_hold_alone_is_a_refund() {
    let f = Fixture::closed();
    // The route limit's void (sent first) gives its hold back; the plan's had expired.
    let mut decision = admitted_with_a_route_limit(&f, "per_day", [Ok(true), Ok(false)]).await;
    assert_eq!(decision.route_limits[0].quota.remaining, 9);
    assert_eq!(f.limiter.refund(&mut decision).await, Ok(true));
    assert_eq!(decision.route_limits[0].quota.remaining, 10);
}

/// A request admitted on the plan and one route limit named `limit` (of 10), with the two voids
/// a refund of it meets scripted: the route limit's is sent first.
async fn admitted_with_a_route_limit<'f>(
    f: &'f Fixture,
    limit: &str,
    voids: [Reply<bool>; 2],
) -> Decision<'f> {
    let answered_at = f.clock.now();
    f.script(|s| {
        s.chains.push_back(Ok(ChainReply::Held {
            roundtrip: Roundtrip::at(answered_at),
            transfer_ids: vec![41, 42],
        }));
        s.voids.extend(voids);
    });
    let key = CallerKey::from_header_value("x-api-key", b"k", 64).unwrap();
    let limits = [test_plan(limit, 10)];
    let (decision, _) = f.limiter.check_with(&key, ONE, &limits).await.unwrap();
    assert_eq!(decision.outcome, Outcome::Admitted);
    decision
}

#[tokio::test]
async fn a_refund_gives_back_every_hold_it_can_even_when_one_void_fails() {
    let f = Fixture::closed();
    // The route limit's void (sent first) times out; the plan's goes through.
    let voids = [Err(timeout()), Ok(true)];
    let mut decision = admitted_with_a_route_limit(&f, "per_second", voids).await;
    assert_eq!(decision.quota.remaining, CAPACITY - 1);
    f.calls();
    assert_eq!(f.limiter.refund(&mut decision).await, Ok(true));
    assert_eq!(f.calls(), ["void", "void"], "both sent");
    let deadlines = f.limiter.store.0.lock().unwrap().void_deadlines.clone();
    assert_eq!(deadlines.len(), 2);
    assert_eq!(deadlines[0], deadlines[1], "by one deadline");
    assert_eq!(
        decision.quota.remaining, CAPACITY,
        "the plan's hold is back"
    );
    assert_eq!(
        decision.route_limits[0].quota.remaining, 9,
        "that one expires instead"
    );
}

/// A void whose answer is lost may have landed: the view forgets the caller rather than count
/// the hold on (429s from memory for credit the ledger has back).
#[tokio::test]
async fn a_refund_whose_void_is_unanswered_makes_the_view_forget_the_caller() {
    let f = Fixture::closed();
    let held = f.held();
    f.script(|s| {
        s.holds.push_back(held);
        s.voids.push_back(Err(timeout()));
    });
    let key = CallerKey::from_header_value("x-api-key", b"k", 64).unwrap();
    let mut decision = f.limiter.check(&key, ONE).await.unwrap();
    assert_eq!(f.limiter.local_callers(), 1);
    let _unknown = f.limiter.refund(&mut decision).await;
    assert_eq!(f.calls(), ["hold", "void"]);
    assert_eq!(f.limiter.local_callers(), 0, "forgotten");
}

/// A refund dropped while its void is out (its request's client gone): the void runs at the
/// ledger in a task of its own and may land, so the view forgets the caller rather than count
/// the hold on, as for a void whose answer is lost.
#[tokio::test]
async fn a_refund_dropped_while_its_void_is_out_makes_the_view_forget_the_caller() {
    let f = Fixture::closed();
    let held = f.held();
    f.script(|s| {
        s.holds.push_back(held);
        s.void_stalls = true;
    });
    let key = CallerKey::from_header_value("x-api-key", b"k", 64).unwrap();
    let mut decision = f.limiter.check(&key, ONE).await.unwrap();
    assert_eq!(f.limiter.local_callers(), 1);
    let refund = f.limiter.refund(&mut decision);
    let dropped = tokio::time::timeout(Duration::from_millis(10), refund).await;
    assert!(dropped.is_err(), "the void is never answered");
    assert_eq!(f.calls(), ["hold", "void"]);
    assert_eq!(f.limiter.local_callers(), 0, "forgotten");
}

/// The ledger refuses the hold on a closed account, and the read that says why (a block, a
/// move) fails: refused whatever the policy (the ledger said no), but for a second, not the
/// longest window (a moved caller follows at its next request).
#[tokio::test]
async fn a_closed_account_whose_read_fails_is_refused_for_a_second_under_either_policy() {
    let f = Fixture::new(FailurePolicy::Open, UnknownKeys::DefaultPlan);
    f.script(|s| {
        s.holds.push_back(Ok(HoldReply::Blocked));
        s.views.push_back(Err(timeout()));
    });
    let decision = f.check(ONE).await;
    assert_eq!(limited_by(&decision), Some((1, DecisionSource::Ledger)));
    assert_eq!(decision.quota.remaining, 0);
    assert_eq!(f.calls(), ["hold", "view"]);
}

#[tokio::test]
async fn nothing_to_refund_without_a_pending_hold() {
    let f = Fixture::closed();
    let held = f.held();
    f.script(|s| {
        s.holds.push_back(held);
        s.voids.push_back(Ok(false));
        s.holds.push_back(Err(timeout()));
    });
    let key = CallerKey::from_header_value("x-api-key", b"k", 64).unwrap();
    let mut decision = f.limiter.check(&key, ONE).await.unwrap();
    // It expired meanwhile: nothing comes back, and the view keeps the hold (errs to holding).
    assert_eq!(f.limiter.refund(&mut decision).await, Ok(false));
    let mut failed = f.limiter.check(&key, ONE).await.unwrap();
    assert_eq!(failed.quota.remaining, CAPACITY - 1);
    // A decision that placed no hold makes no call.
    assert_eq!(failed.hold, None);
    f.calls();
    assert_eq!(f.limiter.refund(&mut failed).await, Ok(false));
    assert!(f.calls().is_empty());
}

#[tokio::test]
async fn a_closed_plan_under_route_limits_is_read_once_and_a_move_followed() {
    let f = Fixture::closed();
    let key = CallerKey::from_header_value("x-api-key", b"k", 64).unwrap();
    let per_second = [test_plan("per_second", 10)];
    let closed = |moved_to: Option<&str>| AccountView {
        blocked: Some(Blocked {
            until: Some(f.clock.wall() + Duration::from_secs(60)),
            moved_to: moved_to.map(model::plan_tag),
        }),
        ..f.view(CAPACITY, &[], true)
    };
    let refused = Ok(ChainReply::Refused {
        index: 0,
        refusal: crate::ledger::LinkRefusal::Closed,
    });
    // Blocked: the refusal's read of the account is the only one.
    f.script(|s| {
        s.chains.push_back(refused.clone());
        s.views.push_back(Ok(Some(closed(None))));
    });
    let (blocked, _) = f.limiter.check_with(&key, ONE, &per_second).await.unwrap();
    assert!(matches!(blocked.outcome, Outcome::Blocked { .. }));
    assert_eq!(f.calls(), ["chain", "view"]);
    // Moved: followed to the new plan from that same read.
    let answered_at = f.clock.now();
    f.script(|s| {
        s.chains.push_back(refused);
        s.views.push_back(Ok(Some(closed(Some("pro")))));
        s.chains.push_back(Ok(ChainReply::Held {
            roundtrip: Roundtrip::at(answered_at),
            transfer_ids: vec![1, 2],
        }));
    });
    let key = CallerKey::from_header_value("x-api-key", b"m", 64).unwrap();
    let (moved, _) = f.limiter.check_with(&key, ONE, &per_second).await.unwrap();
    assert_eq!(moved.outcome, Outcome::Admitted);
    assert_eq!(moved.plan.name(), "pro");
    assert_eq!(f.calls(), ["chain", "view", "chain"]);
}

#[test]
fn seconds_round_up() {
    assert_eq!(whole_seconds_up(Duration::ZERO), 0);
    assert_eq!(whole_seconds_up(Duration::from_millis(1)), 1);
    assert_eq!(whole_seconds_up(Duration::from_secs(2)), 2);
    assert_eq!(whole_seconds_up(Duration::from_millis(2001)), 3);
}

#[tokio::test]
async fn a_moved_caller_is_followed_once_then_charged_on_its_new_plan() {
    let f = Fixture::closed();
    let moved = AccountView {
        blocked: Some(Blocked {
            until: None,
            moved_to: Some(model::plan_tag("pro")),
        }),
        ..f.view(CAPACITY, &[], true)
    };
    let held = f.held();
    f.script(|s| {
        s.holds.extend([Ok(HoldReply::Blocked), held]);
        s.views.push_back(Ok(Some(moved)));
    });
    let decision = f.check(ONE).await;
    assert_eq!(decision.outcome, Outcome::Admitted);
    assert_eq!(decision.plan.name(), "pro");
    assert_eq!(decision.quota.limit, 2 * CAPACITY);
    assert_eq!(f.calls(), ["hold", "view", "hold"]);
    let held = f.held();
    f.script(|s| s.holds.push_back(held));
    assert_eq!(f.check(ONE).await.plan.name(), "pro");
    assert_eq!(f.calls(), ["hold"], "the move is remembered");
    let accounts = f.limiter.store.0.lock().unwrap().held_accounts.clone();
    assert_ne!(accounts[0], accounts[1]);
    assert_eq!(accounts[1], accounts[2]);
}

#[tokio::test]
async fn a_move_to_a_plan_this_configuration_lacks_is_refused_as_blocked() {
    let f = Fixture::closed();
    let moved = AccountView {
        blocked: Some(Blocked {
            until: None,
            moved_to: Some(model::plan_tag("gold")),
        }),
        ..f.view(CAPACITY, &[], true)
    };
    f.script(|s| {
        s.holds.push_back(Ok(HoldReply::Blocked));
        s.views.push_back(Ok(Some(moved)));
    });
    let decision = f.check(ONE).await;
    let Outcome::Blocked {
        retry_after_seconds,
        ..
    } = decision.outcome
    else {
        panic!("{:?}", decision.outcome);
    };
    // `t` as long as the Retry-After, as on any block (it said `t=0`).
    assert_eq!(decision.quota.reset_seconds, retry_after_seconds);
}

/// A library user renders its scrape after `drain_counts` alone (as the README says): the
/// store's own gauges (the ledger's calls in flight, its batches) are published there too. They
/// were published by the binary's `/metrics` alone, and stayed at 0 for everyone else.
#[test]
fn draining_the_counts_publishes_the_stores_gauges() {
    let f = Fixture::closed();
    f.limiter.drain_counts();
    f.script(|s| assert_eq!(s.published_at_scrape, 1));
}

/// A quota given back whole resets now; one still short keeps its reset.
#[test]
fn a_quota_given_back_whole_resets_at_once() {
    let quota = |remaining| Quota {
        limit: 5,
        window_seconds: 30,
        remaining,
        reset_seconds: 31,
    };
    let mut whole = quota(4);
    super::credit_back(&mut whole, 1);
    assert_eq!((whole.remaining, whole.reset_seconds), (5, 0));
    let mut short = quota(2);
    super::credit_back(&mut short, 1);
    assert_eq!((short.remaining, short.reset_seconds), (3, 31));
}

/// A refusal whose listing fails says to come back after the caller's own plan's window, not
/// the longest of every plan's: a caller on a plan of a second was told a day when another plan
/// was daily.
#[tokio::test]
async fn a_refusal_whose_listing_fails_waits_out_the_callers_own_window() {
    let plan = |name: &str, seconds: u32| {
        Plan::new(
            name,
            NonZeroU64::new(CAPACITY).unwrap(),
            std::num::NonZeroU32::new(seconds).unwrap(),
        )
        .unwrap()
    };
    let plans = PlanBook::new(
        vec![plan("second", 1), plan("daily", 86_400)],
        "second",
        [],
        [],
        UnknownKeys::DefaultPlan,
    )
    .unwrap();
    let f = Fixture::closed();
    let settings = f.limiter.settings().clone();
    let store = FakeStore(Mutex::new(Script::default()));
    let f = Fixture {
        limiter: Limiter::with_seams(store, f.clock.clone(), Arc::new(plans), settings),
        clock: f.clock,
    };
    f.script(|s| {
        s.holds.push_back(Ok(HoldReply::ExceedsCredits));
        s.views.push_back(Err(timeout()));
    });
    let decision = f.check(ONE).await;
    assert_eq!(limited_by(&decision), Some((1, DecisionSource::Ledger)));
    assert_eq!(f.calls(), ["hold", "view"]);
}
