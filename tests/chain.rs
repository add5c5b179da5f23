//! Several limits per request against a real TigerBeetle: one linked chain of holds, all or none.

mod common;

use std::num::{NonZeroU32, NonZeroU64};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use futures_util::future::join_all;
use ledger_limiter::ledger::model::UserAccount;
use ledger_limiter::ledger::{ChainLink, ChainReply, HoldReply, Ledger, LinkRefusal, Roundtrip};
use ledger_limiter::limiter::plan::Plan;
use ledger_limiter::limiter::{DecisionSource, Limit, Limiter, Outcome};

fn limiter(ledger: Ledger) -> Limiter {
    let plan = Plan::new(
        "free",
        NonZeroU64::new(5).unwrap(),
        NonZeroU32::new(30).unwrap(),
    );
    one_plan_limiter(ledger, plan.unwrap())
}

/// A limit on an account no other test uses.
fn fresh_limit(capacity: u64, window_seconds: u32, cost: u64) -> Limit {
    Limit {
        account: UserAccount {
            id: rand::random::<u128>() | 1 << 127,
            capacity: NonZeroU64::new(capacity).unwrap(),
            window_seconds: NonZeroU32::new(window_seconds).unwrap(),
        },
        cost,
        local_view: true,
        lease: None,
    }
}

async fn available(ledger: &Ledger, limit: &Limit) -> Option<u64> {
    let deadline = Instant::now() + Duration::from_secs(5);
    let view = ledger.account_view(limit.account.id, 3600, deadline).await;
    view.expect("the ledger answers").map(|v| v.available)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_on_two_limits_admit_exactly_the_tighter_one() {
    let address = shared_ledger().address;
    // Two instances (two clients, two local views) on one ledger.
    let instances = [
        limiter(ledger_client(vec![address])),
        limiter(ledger_client(vec![address])),
    ];
    let minute = fresh_limit(12, 60, 1);
    let hour = fresh_limit(30, 3600, 1);
    let requests = (0..40).map(|i| {
        let limiter = &instances[i % 2];
        async move { limiter.check_all(&[minute, hour]).await.unwrap() }
    });
    let decisions = join_all(requests).await;
    let admitted = decisions
        .iter()
        .filter(|d| d.outcome == Outcome::Admitted)
        .count();
    assert_eq!(admitted, 12, "exactly the tighter limit's capacity");
    for decision in &decisions {
        match decision.outcome {
            Outcome::Admitted => assert!(decision.limits.iter().all(|l| l.hold.is_some())),
            Outcome::Limited { .. } => assert_eq!(decision.refused_by, Some(0)),
            ref other => panic!("{other:?}"),
        }
    }
    // A denied request consumed nothing on the other limit.
    let ledger = instances[0].ledger();
    assert_eq!(available(ledger, &minute).await, Some(0));
    assert_eq!(available(ledger, &hour).await, Some(30 - 12));
}

/// A limit's hold given back on another instance (an Envoy negative hit there, a release) frees
/// credit this instance's listing still counts as held: it refuses from memory for
/// `LISTING_TRUSTED_FOR` at most, then one request lists the account again, finds room, and
/// the chain is placed. Before, the listing refused until the given-back hold's window ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_given_back_on_another_instance_admits_again_within_seconds() {
    use ledger_limiter::limiter::local_view::LISTING_TRUSTED_FOR;
    let address = shared_ledger().address;
    let a = limiter(ledger_client(vec![address]));
    let b = limiter(ledger_client(vec![address]));
    let limit = fresh_limit(2, 60, 1);
    let first = a.check_all(&[limit]).await.unwrap();
    let second = a.check_all(&[limit]).await.unwrap();
    assert_eq!(
        (first.outcome, second.outcome),
        (Outcome::Admitted, Outcome::Admitted)
    );
    let source = |outcome: &Outcome| match outcome {
        Outcome::Limited { source, .. } => Some(*source),
        _ => None,
    };
    // B: the ledger refuses, B lists the account; then B refuses from memory.
    let refused = b.check_all(&[limit]).await.unwrap().outcome;
    let listed_at = Instant::now();
    assert_eq!(source(&refused), Some(DecisionSource::Ledger));
    let refused = b.check_all(&[limit]).await.unwrap().outcome;
    assert_eq!(source(&refused), Some(DecisionSource::LocalView));
    // A gives its first hold back.
    let hold = first.limits[0].hold.expect("admitted: held");
    assert_eq!(a.release(limit.account.id, hold).await, Ok(true));
    let lapsed = listed_at + LISTING_TRUSTED_FOR + Duration::from_millis(100);
    tokio::time::sleep_until(lapsed.into()).await;
    let admitted = b.check_all(&[limit]).await.unwrap().outcome;
    assert_eq!(admitted, Outcome::Admitted, "listed again, room found");
    let refused = b.check_all(&[limit]).await.unwrap().outcome;
    assert!(source(&refused).is_some(), "{refused:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denied_request_consumes_nothing_on_any_limit() {
    let address = shared_ledger().address;
    let a = limiter(ledger_client(vec![address]));
    let b = limiter(ledger_client(vec![address]));
    let small = fresh_limit(5, 60, 3);
    let large = fresh_limit(100, 60, 3);
    let first = a.check_all(&[large, small]).await.unwrap();
    assert_eq!(first.outcome, Outcome::Admitted);
    assert_eq!(first.limits[1].quota.remaining, 2);
    // Instance b knows nothing of the caller: the ledger refuses the chain at its second link.
    let denied = b.check_all(&[large, small]).await.unwrap();
    assert!(
        matches!(
            denied.outcome,
            Outcome::Limited {
                source: DecisionSource::Ledger,
                ..
            }
        ),
        "{denied:?}"
    );
    assert_eq!(denied.refused_by, Some(1));
    assert_eq!(available(b.ledger(), &large).await, Some(97));
    assert_eq!(available(b.ledger(), &small).await, Some(2));
    // Giving the admitted request's holds back restores both limits.
    for (limit, status) in [large, small].iter().zip(&first.limits) {
        let hold = status.hold.expect("admitted: held");
        assert_eq!(a.release(limit.account.id, hold).await, Ok(true));
    }
    assert_eq!(available(a.ledger(), &large).await, Some(100));
    assert_eq!(available(a.ledger(), &small).await, Some(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_that_costs_nothing_holds_nothing_and_opens_no_account() {
    let limiter = limiter(ledger_client(vec![shared_ledger().address]));
    let free = fresh_limit(5, 60, 0);
    let counted = fresh_limit(5, 60, 1);
    let decision = limiter.check_all(&[free, counted]).await.unwrap();
    assert_eq!(decision.outcome, Outcome::Admitted);
    assert_eq!(decision.limits[0].hold, None);
    assert_eq!(decision.limits[0].quota.remaining, 5);
    assert_eq!(
        available(limiter.ledger(), &free).await,
        None,
        "never opened"
    );
    assert_eq!(available(limiter.ledger(), &counted).await, Some(4));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ledger_names_the_link_that_refused() {
    let ledger = ledger_client(vec![shared_ledger().address]);
    let known = fresh_limit(2, 60, 1);
    let limiter = limiter(ledger.clone());
    limiter.check_all(&[known]).await.unwrap();
    let link = |limit: &Limit, amount| ChainLink {
        account_id: limit.account.id,
        amount,
        timeout_seconds: 60,
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    let unknown = fresh_limit(2, 60, 1);
    let reply = ledger
        .hold_chain(vec![link(&known, 1), link(&unknown, 1)], deadline, true)
        .await;
    let refused = |index, refusal| Ok(ChainReply::Refused { index, refusal });
    assert_eq!(reply, refused(1, LinkRefusal::AccountNotFound));
    let reply = ledger
        .hold_chain(vec![link(&known, 5), link(&known, 1)], deadline, true)
        .await;
    assert_eq!(reply, refused(0, LinkRefusal::ExceedsCredits));
    // Neither failed chain held anything.
    assert_eq!(available(&ledger, &known).await, Some(1));
}

/// A hold's and a chain's `Roundtrip` bracket the ledger's work: the send taken before the call
/// went, the answer's instant once it came (the local view counts a hold a listing lists once by
/// its send, and bounds its expiry by its answer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holds_roundtrip_is_sent_before_it_is_answered() {
    let ledger = ledger_client(vec![shared_ledger().address]);
    let limit = fresh_limit(5, 60, 1);
    let deadline = Instant::now() + Duration::from_secs(5);
    ledger.provision(&limit.account, deadline).await.unwrap();
    let brackets = |before: Instant, roundtrip: Roundtrip, after: Instant| {
        before <= roundtrip.sent_at
            && roundtrip.sent_at < roundtrip.answered_at
            && roundtrip.answered_at <= after
    };
    let before = Instant::now();
    let held = ledger.hold(limit.account.id, 1, 60, deadline, true).await;
    let Ok(HoldReply::Held { roundtrip, .. }) = held else {
        panic!("held: {held:?}");
    };
    assert!(brackets(before, roundtrip, Instant::now()), "{roundtrip:?}");
    let link = ChainLink {
        account_id: limit.account.id,
        amount: 1,
        timeout_seconds: 60,
    };
    let before = Instant::now();
    let chained = ledger.hold_chain(vec![link], deadline, true).await;
    let Ok(ChainReply::Held { roundtrip, .. }) = chained else {
        panic!("held: {chained:?}");
    };
    assert!(brackets(before, roundtrip, Instant::now()), "{roundtrip:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_given_back_is_no_longer_listed_as_live() {
    // A voided hold remains a pending transfer in the ledger; the listing that times Retry-After
    // and fills the local view must not count it (else an instance refuses what the ledger admits).
    let limiter = limiter(ledger_client(vec![shared_ledger().address]));
    let limit = fresh_limit(3, 60, 1);
    let first = limiter.check_all(&[limit]).await.unwrap();
    limiter.check_all(&[limit]).await.unwrap();
    let hold = first.limits[0].hold.expect("held");
    assert_eq!(limiter.release(limit.account.id, hold).await, Ok(true));
    let deadline = Instant::now() + Duration::from_secs(5);
    let view = limiter
        .ledger()
        .account_view(limit.account.id, 60, deadline)
        .await;
    let view = view.unwrap().expect("the account");
    assert_eq!((view.available, view.holds.len()), (2, 1));
}

/// Releases by amount at once (Envoy's negative hits from two instances, as requests end
/// together): each gives back what it asked, the two together every hold, and an operator's
/// block on the account is never taken for a hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_releases_give_back_every_unit_they_ask_for() {
    use ledger_limiter::ledger::model::Actor;
    let address = shared_ledger().address;
    let instances = [
        limiter(ledger_client(vec![address])),
        limiter(ledger_client(vec![address])),
    ];
    let limit = fresh_limit(40, 60, 1);
    for i in 0..40 {
        let decision = instances[i % 2].check_all(&[limit]).await.unwrap();
        assert_eq!(decision.outcome, Outcome::Admitted);
    }
    let ledger = instances[0].ledger();
    assert_eq!(available(ledger, &limit).await, Some(0));
    // A block is a pending transfer on the account too, and must stay.
    let deadline = Instant::now() + Duration::from_secs(10);
    let actor = Actor::from_reason(1, "test").unwrap();
    ledger
        .block(limit.account.id, 600, actor, deadline)
        .await
        .unwrap();
    let instances = &instances;
    let releases = (0..4).map(|i| async move {
        let deadline = Instant::now() + Duration::from_secs(10);
        let ledger = instances[i % 2].ledger();
        ledger
            .release_units(limit.account.id, 10, 60, deadline)
            .await
            .unwrap()
    });
    let released: Vec<u64> = join_all(releases).await.iter().map(|r| r.units).collect();
    assert_eq!(released, [10, 10, 10, 10], "each got back what it asked");
    assert_eq!(available(ledger, &limit).await, Some(40));
    let why = ledger_limiter::ledger::model::Actor::from_reason(1, "test").unwrap();
    let unblocked = ledger
        .unblock(limit.account.id, why, deadline)
        .await
        .unwrap();
    assert_eq!(
        unblocked,
        ledger_limiter::ledger::Unblocking::Done,
        "the block stayed"
    );
}

/// A release of more than is held gives back what is, with one listing: another round reads the
/// account again only when another release voided holds this one chose (it read it again
/// whenever it fell short, up to 16 pages more for nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_of_more_than_is_held_lists_the_account_once() {
    use ledger_limiter::ledger::metrics::Operation;
    let instance = limiter(ledger_client(vec![shared_ledger().address]));
    let limit = fresh_limit(10, 60, 1);
    for _ in 0..3 {
        let decision = instance.check_all(&[limit]).await.unwrap();
        assert_eq!(decision.outcome, Outcome::Admitted);
    }
    let ledger = instance.ledger();
    let listings = || ledger.calls_started_of(Operation::GetAccountTransfers);
    let before = listings();
    let deadline = Instant::now() + Duration::from_secs(10);
    let released = ledger
        .release_units(limit.account.id, 5, 60, deadline)
        .await
        .unwrap();
    assert_eq!((released.units, released.available), (3, Some(10)));
    assert_eq!(listings() - before, 1, "one listing");
}

/// A busy account's release finds its live holds: they are its newest transfers, past the first
/// 16 pages of its window read oldest first, where holds voided long ago looked live (their voids
/// were past the pages read) and a release gave back nothing. Here 2,100 holds, the oldest 2,090
/// voided: 4,190 transfers in the window, 10 live holds at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_on_a_busy_account_finds_its_live_holds() {
    use ledger_limiter::ledger::model;
    let instance = limiter(ledger_client(vec![shared_ledger().address]));
    let limit = fresh_limit(10_000, 60, 1);
    // Provisions the account (and takes one unit, given back below).
    let first = instance.check_all(&[limit]).await.unwrap();
    assert_eq!(first.outcome, Outcome::Admitted);
    let ledger = instance.ledger();
    let deadline = Instant::now() + Duration::from_secs(30);
    let released = ledger
        .release_units(limit.account.id, 1, 60, deadline)
        .await
        .unwrap();
    assert_eq!(released.units, 1);
    let client =
        tigerbeetle_unofficial::Client::new(0, shared_ledger().address.to_string()).unwrap();
    let ledger_id = ledger.ledger_id();
    let holds: Vec<_> = (0..2_100)
        .map(|_| model::hold_transfer(limit.account.id, ledger_id, 1, 60))
        .collect();
    let voids: Vec<_> = holds[..2_090]
        .iter()
        .map(|hold| model::void_transfer(hold.id(), ledger_id))
        .collect();
    for batch in holds.chunks(200).chain(voids.chunks(200)) {
        client.create_transfers(batch.to_vec()).await.unwrap();
    }
    assert_eq!(available(ledger, &limit).await, Some(10_000 - 10));

    let released = ledger
        .release_units(limit.account.id, 10, 60, deadline)
        .await
        .unwrap();
    assert_eq!(released.units, 10, "every live hold found");
    assert_eq!(available(ledger, &limit).await, Some(10_000));
}

/// A block is an operator action like the others: it moves the operator epoch, which every
/// instance reads once a second (to drop its leases and local view of the caller).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_moves_the_operator_epoch() {
    use ledger_limiter::ledger::model::Actor;
    // A ledger of its own: on the shared one, other tests' operator actions move the epoch too,
    // and `after > before` held whatever a block did.
    let own = TestLedger::start();
    let instance = limiter(ledger_client(vec![own.address]));
    let limit = fresh_limit(5, 60, 1);
    let decision = instance.check_all(&[limit]).await.unwrap();
    assert_eq!(decision.outcome, Outcome::Admitted);
    let ledger = instance.ledger();
    let deadline = Instant::now() + Duration::from_secs(10);
    let before = ledger.operator_epoch(deadline).await.unwrap();
    let actor = Actor::from_reason(1, "test").unwrap();
    ledger
        .block(limit.account.id, 600, actor, deadline)
        .await
        .unwrap();
    let after = ledger.operator_epoch(deadline).await.unwrap();
    assert_eq!(after, before + 1, "one action, one step of the epoch");
}

/// A call whose deadline has passed is not sent: nobody waits for it (and a hold that landed
/// would have to be voided).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_past_its_deadline_is_not_sent() {
    let ledger = ledger_client(vec![shared_ledger().address]);
    let sent = ledger.calls_started();
    let late = ledger.ping(Instant::now()).await;
    assert!(
        matches!(
            late,
            Err(ledger_limiter::ledger::LedgerError::Timeout { .. })
        ),
        "{late:?}"
    );
    assert_eq!(ledger.calls_started(), sent, "sent anyway");
    let deadline = Instant::now() + Duration::from_secs(10);
    ledger.ping(deadline).await.expect("in time, it is sent");
    assert_eq!(ledger.calls_started(), sent + 1);
}

/// The Envoy front end's over-charge (a charge that did not fit spends what remains) is a
/// balancing hold; the audit counts it apart, so `holds − voids` stays the requests admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_over_charge_holds_what_remains_and_is_audited_apart() {
    let ledger = ledger_client(vec![shared_ledger().address]);
    let limit = fresh_limit(5, 30, 1);
    let deadline = Instant::now() + Duration::from_secs(10);
    ledger.provision(&limit.account, deadline).await.unwrap();
    let id = limit.account.id;
    let held = ledger.hold(id, 3, 30, deadline, false).await.unwrap();
    assert!(matches!(held, HoldReply::Held { .. }));
    // 7 asked, 2 free: the 2 are held.
    ledger.hold_what_remains(id, 7, 30, deadline).await.unwrap();
    assert_eq!(available(&ledger, &limit).await, Some(0));
    let audit = ledger.audit(id, deadline).await.unwrap().unwrap();
    assert_eq!((audit.holds, audit.over_charges), (1, 1));
    assert_eq!(audit.debits_pending, 5);
    let kinds: Vec<&str> = audit.recent.iter().map(|t| t.kind.as_str()).collect();
    assert_eq!(kinds, ["grant", "hold", "over_charge"]);
    // A negative hit gives back what requests took, never an over-charge (a refusal): voided,
    // it was counted as a request's void, and the audit's admitted requests came out 0.
    let released = ledger.release_units(id, 2, 30, deadline).await.unwrap();
    assert_eq!(released.units, 0, "the request's hold is 3: none of 2 fits");
    let released = ledger.release_units(id, 3, 30, deadline).await.unwrap();
    assert_eq!(released.units, 3);
    let audit = ledger.audit(id, deadline).await.unwrap().unwrap();
    assert_eq!((audit.holds, audit.voids, audit.over_charges), (1, 1, 1));
    assert_eq!(audit.debits_pending, 2, "the over-charge stands");
    // A refused charge that fits by now (holds expired since the ledger said no) is never held
    // in full: a refused request does not pay its price.
    let limit = fresh_limit(10, 30, 1);
    ledger.provision(&limit.account, deadline).await.unwrap();
    let id = limit.account.id;
    ledger.hold_what_remains(id, 4, 30, deadline).await.unwrap();
    assert_eq!(available(&ledger, &limit).await, Some(7), "3 of the 4 held");
}

/// A plan's window edited since its caller's account was made: the account id leaves the window
/// out, so provisioning again finds the account with another `user_data_32` and takes it as
/// made (the old window stays on it, for the audit). It was an unexpected error, which the
/// failure policy then decided on every request of a caller whose credit was 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_account_made_under_another_window_counts_as_provisioned() {
    let ledger = ledger_client(vec![shared_ledger().address]);
    let limit = fresh_limit(5, 60, 1);
    let deadline = Instant::now() + Duration::from_secs(5);
    ledger.provision(&limit.account, deadline).await.unwrap();
    let edited = UserAccount {
        window_seconds: NonZeroU32::new(30).unwrap(),
        ..limit.account
    };
    ledger.provision(&edited, deadline).await.expect("exists");
    assert_eq!(available(&ledger, &limit).await, Some(5), "granted once");
}

/// A recharge (a cost known after the response) whose caller an operator blocked meanwhile:
/// the ledger voids the estimate's hold but places none on a closed account, so the chain
/// fails; that is an operator's doing, not an unexpected answer of the ledger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recharge_on_a_blocked_account_changes_nothing_and_says_closed() {
    use ledger_limiter::ledger::model::Actor;
    use ledger_limiter::ledger::settle::{Recharge, Recharged};
    let ledger = ledger_client(vec![shared_ledger().address]);
    let limit = fresh_limit(5, 60, 1);
    let deadline = Instant::now() + Duration::from_secs(5);
    ledger.provision(&limit.account, deadline).await.unwrap();
    let id = limit.account.id;
    let HoldReply::Held { transfer_id, .. } =
        ledger.hold(id, 2, 60, deadline, false).await.unwrap()
    else {
        panic!("held");
    };
    let actor = Actor::from_reason(1, "test").unwrap();
    ledger.block(id, 600, actor, deadline).await.unwrap();
    let recharge = Recharge {
        pending_id: transfer_id,
        account_id: id,
        amount: 1,
        timeout_seconds: 50,
    };
    let recharged = ledger.recharge(&[recharge], deadline).await;
    assert_eq!(recharged, Ok(Recharged::Closed));
    let audit = ledger.audit(id, deadline).await.unwrap().unwrap();
    assert_eq!((audit.holds, audit.voids), (1, 0), "the estimate stands");
}

/// A block that lands between a new caller's account and its grant fails the grant for good
/// (a transient refusal: TigerBeetle never lets that id succeed). Once unblocked, provisioning
/// moves on to the next grant id, and the caller is credited once, not never.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_refused_by_a_block_is_made_under_the_next_id_once_unblocked() {
    use ledger_limiter::ledger::model::{self, Actor};
    let ledger = ledger_client(vec![shared_ledger().address]);
    let raw = tigerbeetle_unofficial::Client::new(0, shared_ledger().address.to_string()).unwrap();
    let limit = fresh_limit(5, 60, 1);
    let id = limit.account.id;
    let ledger_id = ledger.ledger_id();
    // The accounts alone, as a provisioning cut short after its first call leaves them.
    let accounts = vec![
        model::operator_account(ledger_id),
        model::user_account(&limit.account, ledger_id),
    ];
    let _ = raw.create_accounts(accounts).await; // the operator's may exist: either way
    let deadline = Instant::now() + Duration::from_secs(5);
    let actor = Actor::from_reason(1, "test").unwrap();
    ledger.block(id, 600, actor, deadline).await.unwrap();
    let refused = ledger.provision(&limit.account, deadline).await;
    assert!(
        refused.is_err(),
        "a closed account takes no grant: {refused:?}"
    );
    ledger.unblock(id, actor, deadline).await.unwrap();
    ledger
        .provision(&limit.account, deadline)
        .await
        .expect("the next id");
    ledger
        .provision(&limit.account, deadline)
        .await
        .expect("again: exists");
    assert_eq!(available(&ledger, &limit).await, Some(5), "granted once");
}

/// `count` holds of 1 for 600 s on `limit`'s account, provisioned first, placed directly (200
/// a request: the test ledger runs in development mode, 32 KiB requests).
async fn holds_placed(
    ledger: &Ledger,
    limit: &Limit,
    count: usize,
) -> Vec<tigerbeetle_unofficial::Transfer> {
    use ledger_limiter::ledger::model;
    let raw = tigerbeetle_unofficial::Client::new(0, shared_ledger().address.to_string()).unwrap();
    let (id, ledger_id) = (limit.account.id, ledger.ledger_id());
    let deadline = Instant::now() + Duration::from_secs(30);
    ledger.provision(&limit.account, deadline).await.unwrap();
    let holds: Vec<_> = (0..count)
        .map(|_| model::hold_transfer(id, ledger_id, 1, 600))
        .collect();
    for chunk in holds.chunks(200) {
        raw.create_transfers(chunk.to_vec()).await.unwrap();
    }
    holds
}

/// Voids of every hold of `holds`, placed directly.
async fn voided(ledger: &Ledger, holds: &[tigerbeetle_unofficial::Transfer]) {
    use ledger_limiter::ledger::model;
    let raw = tigerbeetle_unofficial::Client::new(0, shared_ledger().address.to_string()).unwrap();
    let voids: Vec<_> = (holds.iter())
        .map(|hold| model::void_transfer(hold.id(), ledger.ledger_id()))
        .collect();
    for chunk in voids.chunks(200) {
        raw.create_transfers(chunk.to_vec()).await.unwrap();
    }
}

/// One release voids up to `RELEASE_HOLDS_MAX` holds in one request, which a development-mode
/// ledger (32 KiB requests: the default configuration's) takes. 254 voids were refused whole
/// (the request's trailer takes one transfer's room): nothing was given back, ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_of_as_many_holds_as_it_may_fits_one_request() {
    use ledger_limiter::ledger::release::RELEASE_HOLDS_MAX;
    let ledger = ledger_client(vec![shared_ledger().address]);
    let limit = fresh_limit(1_000, 600, 1);
    let id = limit.account.id;
    let deadline = Instant::now() + Duration::from_secs(30);
    holds_placed(&ledger, &limit, RELEASE_HOLDS_MAX + 1).await;
    let released = ledger.release_units(id, 300, 600, deadline).await;
    let released = released.expect("one request the ledger takes");
    assert_eq!(released.units, RELEASE_HOLDS_MAX as u64);
    assert_eq!(
        available(&ledger, &limit).await,
        Some(1_000 - 1),
        "one left"
    );
}

/// A block is found past thousands of debits landed on the closed account after it (voids: of
/// refunds, lease settlements, an Envoy caller's released units). Before, it was looked for in
/// the latest 16 pages of 254 debits of any code: past them, an unblock answered "not blocked"
/// and the account stayed closed (and a moved caller was refused as blocked, not followed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_is_found_past_thousands_of_voids_after_it() {
    use ledger_limiter::ledger::model::Actor;
    use ledger_limiter::ledger::{Blocking, Unblocking};
    let ledger = ledger_client(vec![shared_ledger().address]);
    let limit = fresh_limit(5_000, 3600, 1);
    let id = limit.account.id;
    let deadline = Instant::now() + Duration::from_secs(30);
    let holds = holds_placed(&ledger, &limit, 4_100).await;
    let actor = Actor::from_reason(1, "test").unwrap();
    let blocked = ledger.block(id, 600, actor, deadline).await.unwrap();
    assert!(matches!(blocked, Blocking::Done { .. }), "{blocked:?}");
    voided(&ledger, &holds).await;
    let unblocked = ledger.unblock(id, actor, deadline).await.unwrap();
    assert_eq!(unblocked, Unblocking::Done);
    assert_eq!(
        available(&ledger, &limit).await,
        Some(5_000),
        "open, all free"
    );
}

/// A move is found past thousands of voids landed on the old account after it: an instance
/// that had not learnt the move reads where the caller went (and follows it), and an unblock of
/// the old account answers "moved". Before, past 16 pages of debits of any code, the caller was
/// refused as blocked (a block with no end), and the unblock answered "not blocked".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_is_found_past_thousands_of_voids_after_it() {
    use ledger_limiter::ledger::model::Actor;
    use ledger_limiter::ledger::{Moving, Unblocking};
    let ledger = ledger_client(vec![shared_ledger().address]);
    let (from, to) = (fresh_limit(5_000, 3600, 1), fresh_limit(10, 60, 1));
    let id = from.account.id;
    let deadline = Instant::now() + Duration::from_secs(30);
    let holds = holds_placed(&ledger, &from, 4_100).await;
    let actor = Actor::from_reason(1, "test").unwrap();
    let moved = ledger.move_caller(id, &to.account, 7, actor, 3600, deadline);
    let moved = moved.await.unwrap();
    assert!(matches!(moved, Moving::Done { .. }), "{moved:?}");
    voided(&ledger, &holds).await;
    let view = ledger.account_view(id, 3600, deadline).await.unwrap();
    let blocked = view.and_then(|view| view.blocked).expect("closed");
    assert_eq!(
        (blocked.moved_to, blocked.until),
        (Some(7), None),
        "followed to plan 7"
    );
    let unblocked = ledger.unblock(id, actor, deadline).await.unwrap();
    assert_eq!(unblocked, Unblocking::Moved);
}

/// A caller's account blocked for 10 minutes, and the clients to act on it: straight to the
/// ledger (`direct`: set-up and clean-up, by `setup`), and through a proxy that can hold an
/// answer back (`proxied`).
struct Blocked {
    direct: ledger_limiter::ledger::Ledger,
    proxy: LedgerProxy,
    proxied: ledger_limiter::ledger::Ledger,
    id: u128,
    actor: ledger_limiter::ledger::model::Actor,
    setup: Instant,
}

async fn blocked_behind_a_proxy() -> Blocked {
    use ledger_limiter::ledger::model::Actor;
    use ledger_limiter::ledger::Blocking;
    let direct = ledger_client(vec![shared_ledger().address]);
    let proxy = LedgerProxy::start(shared_ledger().address).await;
    let proxied = ledger_client(vec![proxy.address]);
    let limit = fresh_limit(5, 60, 1);
    let id = limit.account.id;
    let setup = Instant::now() + Duration::from_secs(10);
    direct.provision(&limit.account, setup).await.unwrap();
    let actor = Actor::from_reason(1, "test").unwrap();
    let blocked = direct.block(id, 600, actor, setup).await.unwrap();
    assert!(matches!(blocked, Blocking::Done { .. }), "{blocked:?}");
    Blocked {
        direct,
        proxy,
        proxied,
        id,
        actor,
        setup,
    }
}

impl Blocked {
    /// `act` through the proxy, with the ledger's answer to its transfer of `code` held until
    /// 500 ms before its deadline (3 s away), and what the action asks next held until 50 ms
    /// past it: a refusal that comes late, and a follow-up that needs a deadline of its own (a
    /// second from when it goes, past the hold by 450 ms). The two margins are the test's:
    /// the answer's (proxy, client thread, wake-up) and the follow-up's; 300 ms and 600 ms
    /// left the first too little on a loaded machine.
    async fn answered_late<T, F>(&self, code: u16, act: impl FnOnce(Ledger, Instant) -> F) -> T
    where
        F: std::future::Future<Output = T> + Send + 'static,
        T: Send + 'static,
    {
        let deadline = Instant::now() + Duration::from_secs(3);
        let late = deadline - Duration::from_millis(500);
        let (caught, go) = self.proxy.lose_answer_to(code, late);
        (self.proxy).hold_later_requests_until(deadline + Duration::from_millis(50));
        let acting = tokio::spawn(act(self.proxied.clone(), deadline));
        caught_within(caught).await;
        let _ = go.send(());
        acting.await.unwrap()
    }

    /// Clean-up: the block lifted.
    async fn unblock(self) {
        let unblocked = self.direct.unblock(self.id, self.actor, self.setup).await;
        assert!(unblocked.is_ok(), "{unblocked:?}");
    }
}

/// A block refused late (the account closed already, its answer just before the action's
/// deadline) reads why with a deadline of its own: the read was never sent, past the action's,
/// and the operator got a 503 ("unknown, retry") for a block the ledger had refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_refused_late_still_says_it_was_blocked_already() {
    use ledger_limiter::ledger::model::TRANSFER_CODE_BLOCK;
    use ledger_limiter::ledger::Blocking;
    let blocked = blocked_behind_a_proxy().await;
    let (id, actor) = (blocked.id, blocked.actor);
    let block_again =
        move |ledger: Ledger, deadline| async move { ledger.block(id, 600, actor, deadline).await };
    let again = blocked
        .answered_late(TRANSFER_CODE_BLOCK, block_again)
        .await;
    assert_eq!(again, Ok(Blocking::AlreadyBlocked));
    blocked.unblock().await;
}

/// A top-up or a reduction of a blocked account whose refusal comes late (its answer held until
/// 500 ms before the deadline, its follow-up past it) still says blocked, known not applied: the read of why the account
/// is closed has a deadline of its own, and a read that fails leaves the answer blocked. Before,
/// the read went out with the spent deadline and the operator had a 503 "may have been
/// applied, retry" for a refused action.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_credit_or_debit_refused_late_still_says_blocked() {
    use ledger_limiter::ledger::model::{
        TRANSFER_CODE_REDUCE as REDUCE, TRANSFER_CODE_TOP_UP as TOP_UP,
    };
    use ledger_limiter::ledger::Adjusted;
    let blocked = blocked_behind_a_proxy().await;
    let (id, actor) = (blocked.id, blocked.actor);
    for code in [TOP_UP, REDUCE] {
        let adjust = move |ledger: Ledger, deadline| async move {
            match code {
                TOP_UP => ledger.top_up(id, 1, (actor, None), deadline).await,
                _ => ledger.reduce_credit(id, 1, (actor, None), deadline).await,
            }
        };
        let adjusted = blocked.answered_late(code, adjust).await;
        assert_eq!(adjusted, Ok(Adjusted::Blocked), "transfer code {code}");
    }
    blocked.unblock().await;
}

/// A move to a smaller plan keeps the caller refused for as long as its longest holds live: the
/// old account holds 2 units for 1 s and 8 for 30 s; the new plan allows 2. Each carry is a
/// balancing debit, so the first in the chain takes what is free. Carried shortest first, the
/// 1 s carry took both units and the 30 s one nothing: the new plan admitted 2 requests after a
/// second, while the old plan's 8 still counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_to_a_smaller_plan_carries_the_longest_holds_first() {
    use ledger_limiter::ledger::model::Actor;
    use ledger_limiter::ledger::Moving;
    let ledger = ledger_client(vec![shared_ledger().address]);
    let from = fresh_limit(10, 60, 1);
    let to = fresh_limit(2, 60, 1);
    let deadline = Instant::now() + Duration::from_secs(10);
    ledger.provision(&from.account, deadline).await.unwrap();
    let id = from.account.id;
    // 4 s: still live when the move reads the account, however loaded the machine.
    let short = ledger.hold(id, 2, 4, deadline, false).await.unwrap();
    let long = ledger.hold(id, 8, 30, deadline, false).await.unwrap();
    assert!(matches!(short, HoldReply::Held { .. }) && matches!(long, HoldReply::Held { .. }));
    let actor = Actor::from_reason(1, "test").unwrap();
    let moved = ledger
        .move_caller(id, &to.account, 7, actor, 60, deadline)
        .await;
    assert_eq!(
        moved,
        Ok(Moving::Done { carried: 2 }),
        "no more than the new plan has"
    );
    assert_eq!(available(&ledger, &to).await, Some(0));
    // The 30 s carry took the plan's 2, the short one nothing.
    let audit = ledger
        .audit(to.account.id, deadline)
        .await
        .unwrap()
        .unwrap();
    let carries: Vec<(u128, u32)> = (audit.recent.iter())
        .filter(|t| t.kind == "carried")
        .map(|t| (t.amount, t.timeout_seconds))
        .collect();
    assert!(
        carries.iter().any(|&(amount, s)| amount == 2 && s >= 29),
        "{carries:?}"
    );
    assert!(
        carries.iter().any(|&(amount, s)| amount == 0 && s <= 6),
        "{carries:?}"
    );
    // The short hold's carry (5 s at most) is over; the long one's still holds the whole plan.
    tokio::time::sleep(Duration::from_millis(5_500)).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let after = ledger.hold(to.account.id, 1, 60, deadline, false).await;
    assert_eq!(
        after,
        Ok(HoldReply::ExceedsCredits),
        "refused while the 30 s hold lives"
    );
    assert_eq!(available(&ledger, &to).await, Some(0));
}

/// A top-up whose answer is lost (the ledger stopped past the deadline) lands when the ledger
/// goes on, and every instance must hear of it, as after a top-up answered: those that heard
/// nothing kept refusing the caller from memory, for up to a window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_top_up_whose_answer_is_lost_is_announced_all_the_same() {
    use ledger_limiter::ledger::model::Actor;
    let own = TestLedger::start(); // its own: stopped for a while below
    let ledger = ledger_client(vec![own.address]);
    let limit = fresh_limit(5, 60, 1);
    let deadline = Instant::now() + Duration::from_secs(10);
    ledger.provision(&limit.account, deadline).await.unwrap();
    let actor = Actor::from_reason(1, "test").unwrap();
    ledger
        .top_up(limit.account.id, 1, (actor, None), deadline)
        .await
        .unwrap();
    let epoch = ledger.operator_epoch(deadline).await.unwrap();
    let lost = lose_a_top_up(&own, &ledger, limit.account.id, 3).await;
    assert!(lost.is_err(), "answered past its deadline: {lost:?}");
    let deadline = Instant::now() + Duration::from_secs(10);
    assert_eq!(available(&ledger, &limit).await, Some(9), "it landed");
    let announced = ledger.operator_epoch(deadline).await.unwrap();
    assert!(announced > epoch, "announced: {announced} after {epoch}");
}

/// A top-up whose answer is lost, of a caller whose grant never landed, finishes the grant, as
/// a top-up answered does: nothing else did without a retry (a request takes the top-up's
/// credit for the grant), and the caller kept 3 in place of 5 + 3, for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_top_up_whose_answer_is_lost_finishes_a_grant_that_never_landed() {
    use ledger_limiter::ledger::model;
    let own = TestLedger::start(); // its own: stopped for a while below
    let ledger = ledger_client(vec![own.address]);
    let limit = fresh_limit(5, 60, 1);
    // The accounts alone, as a first request whose grant failed leaves them.
    let raw = tigerbeetle_unofficial::Client::new(0, own.address.to_string()).unwrap();
    let accounts = vec![
        model::operator_account(ledger.ledger_id()),
        model::user_account(&limit.account, ledger.ledger_id()),
    ];
    raw.create_accounts(accounts).await.unwrap();
    assert_eq!(available(&ledger, &limit).await, Some(0), "never granted");
    let lost = lose_a_top_up(&own, &ledger, limit.account.id, 3).await;
    assert!(lost.is_err(), "answered past its deadline: {lost:?}");
    assert_eq!(
        available(&ledger, &limit).await,
        Some(8),
        "granted, and topped up"
    );
}

/// Tops `account_id` up by `amount` with the ledger stopped past the top-up's deadline, and
/// lets the ledger go on once what follows a lost answer has started (its first call: the
/// grant's look-up); what follows has a second of its own from its start.
async fn lose_a_top_up(
    own: &TestLedger,
    ledger: &Ledger,
    account_id: u128,
    amount: u64,
) -> Result<ledger_limiter::ledger::Adjusted, ledger_limiter::ledger::LedgerError> {
    use ledger_limiter::ledger::metrics::Operation;
    use ledger_limiter::ledger::model::Actor;
    let actor = Actor::from_reason(1, "test").unwrap();
    own.pause(true);
    let by = Instant::now() + Duration::from_millis(200);
    let lost = ledger.top_up(account_id, amount, (actor, None), by);
    let go_on = async {
        let lookups = ledger.calls_started_of(Operation::LookupAccounts);
        let waited = Instant::now() + Duration::from_secs(5);
        while ledger.calls_started_of(Operation::LookupAccounts) == lookups
            && Instant::now() < waited
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        own.pause(false);
    };
    tokio::join!(lost, go_on).0
}

/// Two plans of 10 a minute, the caller's old one provisioned, for a move whose request or
/// reply a [`LedgerProxy`] holds: `direct` reaches TigerBeetle itself, `moving` through the
/// proxy.
struct MoveRig {
    direct: Ledger,
    proxy: LedgerProxy,
    moving: Ledger,
    from: Limit,
    to: Limit,
}

type MoveTask = tokio::task::JoinHandle<
    Result<ledger_limiter::ledger::Moving, ledger_limiter::ledger::LedgerError>,
>;

impl MoveRig {
    async fn new() -> MoveRig {
        let direct = ledger_client(vec![shared_ledger().address]);
        let proxy = LedgerProxy::start(shared_ledger().address).await;
        let moving = ledger_client(vec![proxy.address]);
        let (from, to) = (fresh_limit(10, 60, 1), fresh_limit(10, 60, 1));
        let setup = Instant::now() + Duration::from_secs(10);
        direct.provision(&from.account, setup).await.unwrap();
        MoveRig {
            direct,
            proxy,
            moving,
            from,
            to,
        }
    }

    fn actor() -> ledger_limiter::ledger::model::Actor {
        ledger_limiter::ledger::model::Actor::from_reason(1, "test").unwrap()
    }

    /// A request's hold of `amount` on the old account, for `seconds`, placed directly.
    async fn hold(&self, amount: u64, seconds: u32) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let id = self.from.account.id;
        let held = self.direct.hold(id, amount, seconds, deadline, false).await;
        let held = held.unwrap();
        assert!(matches!(held, HoldReply::Held { .. }), "{held:?}");
    }

    /// The move to the new plan, by `deadline`, in a task of its own through the proxy; once
    /// the proxy caught its request (held, its reply held until `answer_at`), with the sender
    /// that lets it on.
    async fn move_caught(
        &self,
        deadline: Instant,
        answer_at: Instant,
    ) -> (MoveTask, tokio::sync::oneshot::Sender<()>) {
        let code = ledger_limiter::ledger::model::TRANSFER_CODE_MOVE;
        let (caught, go) = self.proxy.lose_answer_to(code, answer_at);
        let (id, target, mover) = (self.from.account.id, self.to.account, self.moving.clone());
        let actor = MoveRig::actor();
        let moved =
            tokio::spawn(
                async move { (mover.move_caller(id, &target, 7, actor, 60, deadline)).await },
            );
        caught_within(caught).await;
        (moved, go)
    }

    /// Lets the caught move on (`go`), and its second pass fails: the new account is blocked
    /// for 2 s while the pass is held at the proxy.
    async fn second_pass_fails_while_the_new_account_is_blocked(
        &self,
        go: tokio::sync::oneshot::Sender<()>,
    ) {
        use ledger_limiter::ledger::model::TRANSFER_CODE_CARRY;
        use ledger_limiter::ledger::Blocking;
        let (caught_pass, go_pass) = self
            .proxy
            .lose_answer_to(TRANSFER_CODE_CARRY, Instant::now());
        go.send(()).unwrap();
        caught_within(caught_pass).await;
        let setup = Instant::now() + Duration::from_secs(10);
        let to_id = self.to.account.id;
        let blocked = self.direct.block(to_id, 2, MoveRig::actor(), setup).await;
        assert!(matches!(blocked, Ok(Blocking::Done { .. })), "{blocked:?}");
        go_pass.send(()).unwrap();
    }

    /// What the new account has free once it is `free`, or after 10 s, what it had last.
    async fn free_on_new_once(&self, free: u64) -> Option<u64> {
        let mut now = None;
        for _ in 0..100 {
            now = available(&self.direct, &self.to).await;
            if now == Some(free) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        now
    }
}

/// A request's hold placed while the move makes the new account (provisions it, reads it) is
/// carried once, by the second pass: the balance was read again after that, and the hold
/// counted both as credit the listing left out and as a late hold (8 of 10 carried, 5 live).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_placed_while_the_new_account_is_made_is_carried_once() {
    use ledger_limiter::ledger::model::TRANSFER_CODE_GRANT;
    use ledger_limiter::ledger::Moving;
    let rig = MoveRig::new().await;
    rig.hold(2, 30).await;
    let (caught, go) = rig
        .proxy
        .lose_answer_to(TRANSFER_CODE_GRANT, Instant::now());
    let (id, target, mover) = (rig.from.account.id, rig.to.account, rig.moving.clone());
    let deadline = Instant::now() + Duration::from_secs(5);
    let moved = tokio::spawn(async move {
        (mover.move_caller(id, &target, 7, MoveRig::actor(), 60, deadline)).await
    });
    // The new account's grant caught at the proxy: a request lands meanwhile.
    caught_within(caught).await;
    rig.hold(3, 40).await;
    go.send(()).unwrap();
    let moved = moved.await.unwrap();
    assert!(matches!(moved, Ok(Moving::Done { .. })), "{moved:?}");
    assert_eq!(
        rig.free_on_new_once(5).await,
        Some(5),
        "2 and 3 carried once"
    );
}

/// Until the proxy caught the request its trap was armed for (10 s at most).
async fn caught_within(caught: tokio::sync::oneshot::Receiver<()>) {
    tokio::time::timeout(Duration::from_secs(10), caught)
        .await
        .expect("the request is sent")
        .unwrap();
}

/// A move whose answer is lost (the ledger's reply held past the move's deadline) landed all
/// the same, and a request placed a hold on the old account while the move was on its way. The
/// move is answered as landed, and that hold is carried: before, the move failed, a retry found
/// the caller moved, and the hold counted on no plan (the new one admitted 3 more).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_whose_answer_is_lost_carries_the_holds_placed_meanwhile() {
    use ledger_limiter::ledger::Moving;
    let rig = MoveRig::new().await;
    rig.hold(2, 30).await;
    let deadline = Instant::now() + Duration::from_secs(3);
    let answer_at = deadline + Duration::from_millis(300);
    let (moved, go) = rig.move_caught(deadline, answer_at).await;
    // A request in flight at the move: its hold lands before the move does.
    rig.hold(3, 40).await;
    go.send(()).unwrap();
    let moved = moved.await.unwrap();
    assert!(Instant::now() > deadline, "answered past its deadline");
    assert_eq!(moved, Ok(Moving::Done { carried: 5 }), "both holds carried");
    assert_eq!(available(&rig.direct, &rig.to).await, Some(5));
}

/// A move that lands only after it gave up looking for itself (the ledger held it past the
/// look-up's second, as a stalled primary would): the move answers its error, and when its
/// answer comes the holds placed on the old account meanwhile are carried in the background.
/// Before, they counted on no plan (a retry found the caller moved): the new plan admitted 4
/// more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_that_lands_after_it_gave_up_carries_the_holds_placed_meanwhile() {
    let rig = MoveRig::new().await;
    rig.hold(2, 30).await;
    let deadline = Instant::now() + Duration::from_secs(1);
    let (moved, go) = rig.move_caught(deadline, deadline).await;
    // Requests in flight at the move: their holds land before it does.
    rig.hold(3, 40).await;
    let moved = moved.await.unwrap();
    assert!(moved.is_err(), "gave up on the held move: {moved:?}");
    let done = rig.moving.second_passes_done(Instant::now()).await;
    assert!(!done, "its late answer waited for");
    rig.hold(1, 40).await;
    go.send(()).unwrap();
    assert_eq!(
        rig.free_on_new_once(4).await,
        Some(4),
        "the move's 2 and the late 3 + 1 held on the new plan"
    );
    let done = rig
        .moving
        .second_passes_done(Instant::now() + Duration::from_secs(5));
    assert!(done.await, "the pass counted until its end");
}

/// A move whose caller goes away while its chain is on its way (an operator's request dropped)
/// runs to its end all the same, second pass included. Before, the move landed and its second
/// pass never ran: the holds placed meanwhile counted on no plan, and the new one admitted 3
/// more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_whose_caller_goes_away_still_carries_the_holds_placed_meanwhile() {
    let rig = MoveRig::new().await;
    rig.hold(2, 30).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    let (moved, go) = rig.move_caught(deadline, Instant::now()).await;
    rig.hold(3, 40).await;
    moved.abort();
    assert!(moved.await.unwrap_err().is_cancelled());
    go.send(()).unwrap();
    assert_eq!(
        rig.free_on_new_once(5).await,
        Some(5),
        "the move's 2 and the late 3 held on the new plan"
    );
    let done = rig.moving.second_passes_done(Instant::now()).await;
    assert!(done, "none left");
}

/// A move whose answer is lost and that did not land (the caller blocked meanwhile) leaves no
/// second pass to wait for: the CLI waited its whole 15 s for one, and warned of holds counted
/// on no plan for a move that never happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_move_that_did_not_land_leaves_no_second_pass_to_wait_for() {
    let rig = MoveRig::new().await;
    let deadline = Instant::now() + Duration::from_secs(2);
    // Its answer (that it failed) comes while the move still looks for itself.
    let answer_at = deadline + Duration::from_millis(300);
    let (moved, go) = rig.move_caught(deadline, answer_at).await;
    let setup = Instant::now() + Duration::from_secs(10);
    let id = rig.from.account.id;
    rig.direct
        .block(id, 60, MoveRig::actor(), setup)
        .await
        .unwrap();
    go.send(()).unwrap();
    let moved = moved.await.unwrap();
    assert!(moved.is_err(), "lost, and not found: {moved:?}");
    let done = rig.moving.second_passes_done(Instant::now()).await;
    assert!(done, "none pending");
    assert_eq!(
        available(&rig.direct, &rig.to).await,
        Some(10),
        "nothing carried"
    );
}

/// A move's second pass that fails (here: the new account blocked between the move and the
/// pass) is sent again until it lands (the block over). Before, it was logged and dropped: the
/// holds of requests in flight at the move counted on no plan, and the new one admitted 3 more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moves_second_pass_that_fails_is_sent_again_until_it_lands() {
    use ledger_limiter::ledger::Moving;
    let rig = MoveRig::new().await;
    // No hold before the move: its chain carries nothing, so the first carry is the second pass.
    let deadline = Instant::now() + Duration::from_secs(5);
    let (moved, go) = rig.move_caught(deadline, Instant::now()).await;
    rig.hold(3, 40).await;
    rig.second_pass_fails_while_the_new_account_is_blocked(go)
        .await;
    let moved = moved.await.unwrap();
    assert_eq!(moved, Ok(Moving::Done { carried: 0 }), "its pass failed");
    let done = rig.moving.second_passes_done(Instant::now()).await;
    assert!(!done, "sent again in the background, and counted");
    assert_eq!(
        rig.free_on_new_once(7).await,
        Some(7),
        "the late 3 held on the new plan once the block ended"
    );
    let done = rig
        .moving
        .second_passes_done(Instant::now() + Duration::from_secs(5));
    assert!(done.await, "the pass counted until its end");
}

/// A move's second pass sent again in the background outlives the runtime the move ran on (the
/// admin API's worker, stopped before the service ends): it runs on the ledger's own. Before, it
/// died with that runtime, and the holds of requests in flight at the move counted on no plan.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moves_second_pass_outlives_the_runtime_the_move_ran_on() {
    use ledger_limiter::ledger::model::TRANSFER_CODE_MOVE;
    use ledger_limiter::ledger::Moving;
    let rig = MoveRig::new().await;
    let deadline = Instant::now() + Duration::from_secs(5);
    let (caught, go) = rig.proxy.lose_answer_to(TRANSFER_CODE_MOVE, Instant::now());
    let (id, target, mover) = (rig.from.account.id, rig.to.account, rig.moving.clone());
    // The move on a runtime of its own, dropped once the move has answered.
    let worker = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let moved =
            runtime.block_on(mover.move_caller(id, &target, 7, MoveRig::actor(), 60, deadline));
        drop(runtime);
        moved
    });
    caught_within(caught).await;
    rig.hold(3, 40).await;
    rig.second_pass_fails_while_the_new_account_is_blocked(go)
        .await;
    let moved = tokio::task::spawn_blocking(move || worker.join().unwrap()).await;
    assert_eq!(
        moved.unwrap(),
        Ok(Moving::Done { carried: 0 }),
        "its pass failed"
    );
    assert_eq!(
        rig.free_on_new_once(7).await,
        Some(7),
        "the late 3 held on the new plan once the block ended, its runtime gone"
    );
}

/// A move whose new account is blocked between its read and the move's chain says so: the
/// chain's carries, which debit the new account, fail first, and that refusal was taken for the
/// old account's ("closed", though it was open).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_whose_new_account_is_blocked_meanwhile_says_the_target_is_blocked() {
    use ledger_limiter::ledger::{Blocking, Moving};
    let rig = MoveRig::new().await;
    rig.hold(2, 40).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    let (moved, go) = rig.move_caught(deadline, Instant::now()).await;
    let setup = Instant::now() + Duration::from_secs(10);
    let to_id = rig.to.account.id;
    let blocked = rig.direct.block(to_id, 60, MoveRig::actor(), setup).await;
    assert!(matches!(blocked, Ok(Blocking::Done { .. })), "{blocked:?}");
    go.send(()).unwrap();
    assert_eq!(moved.await.unwrap(), Ok(Moving::TargetBlocked));
    assert_eq!(
        available(&rig.direct, &rig.from).await,
        Some(8),
        "not moved"
    );
}

/// A move back records its own operator and reason, not the first move's: TigerBeetle gives a
/// void's zero fields the pending transfer's values, and the void that reopens the account set
/// none of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_back_records_who_moved_it_back_and_why() {
    use ledger_limiter::ledger::model::{self, Actor};
    use tigerbeetle_unofficial as tb;
    let ledger = ledger_client(vec![shared_ledger().address]);
    let (free, pro) = (fresh_limit(5, 60, 1), fresh_limit(10, 60, 1));
    let deadline = Instant::now() + Duration::from_secs(10);
    ledger.provision(&free.account, deadline).await.unwrap();
    let up = Actor::from_reason(1, "upgrade").unwrap();
    let down = Actor::from_reason(2, "downgrade").unwrap();
    let (from, to) = (free.account.id, pro.account.id);
    ledger
        .move_caller(from, &pro.account, 7, up, 60, deadline)
        .await
        .unwrap();
    ledger
        .move_caller(to, &free.account, 8, down, 60, deadline)
        .await
        .unwrap();
    let client = tb::Client::new(0, shared_ledger().address.to_string()).unwrap();
    let filter = tb::account::Filter::new(from, 100).with_flags(tb::account::FilterFlags::DEBITS);
    let transfers = client
        .get_account_transfers(Box::new(filter))
        .await
        .unwrap();
    let moved_back = transfers
        .iter()
        .find(|t| {
            t.code() == model::TRANSFER_CODE_MOVE
                && t.flags()
                    .contains(tb::transfer::Flags::VOID_PENDING_TRANSFER)
        })
        .expect("the move back's void");
    assert_eq!(moved_back.user_data_32(), 2, "who moved it back");
    assert_eq!(moved_back.user_data_128(), down.why, "and why");
}

/// A block sent just as the last one ends, before TigerBeetle has expired it (5 to 100 ms
/// after), found the account still closed and was answered "blocked already"; the account then
/// reopened, unblocked. It is sent again until the old block has expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_sent_as_the_last_one_ends_lands() {
    use ledger_limiter::ledger::metrics::Operation;
    use ledger_limiter::ledger::model::Actor;
    use ledger_limiter::ledger::operator::Blocking;
    let ledger = ledger_client(vec![shared_ledger().address]);
    let actor = Actor::from_reason(1, "test").unwrap();
    // Until a renewal lands in the window (the old block ended, not yet expired), which its
    // read of why the account is closed shows; a renewal sent after the expiry proves nothing.
    for _ in 0..5 {
        let limit = fresh_limit(5, 60, 1);
        let id = limit.account.id;
        let deadline = Instant::now() + Duration::from_secs(10);
        ledger.provision(&limit.account, deadline).await.unwrap();
        let first = ledger.block(id, 1, actor, deadline).await.unwrap();
        assert!(matches!(first, Blocking::Done { .. }));
        let audit = ledger.audit(id, deadline).await.unwrap().unwrap();
        let block = audit.recent.iter().find(|t| t.kind == "block").unwrap();
        let ends = std::time::UNIX_EPOCH + Duration::from_nanos(block.timestamp_ns + 1_000_000_000);
        let until_then = ends
            .duration_since(std::time::SystemTime::now())
            .unwrap_or_default();
        tokio::time::sleep(until_then + Duration::from_millis(1)).await;
        let reads = ledger.calls_started_of(Operation::GetAccountTransfers);
        let deadline = Instant::now() + Duration::from_secs(2);
        let renewed = ledger.block(id, 600, actor, deadline).await.unwrap();
        assert!(matches!(renewed, Blocking::Done { .. }), "{renewed:?}");
        let reread = ledger.calls_started_of(Operation::GetAccountTransfers) > reads;
        let audit = ledger.audit(id, deadline).await.unwrap().unwrap();
        assert_eq!(audit.blocks, 2);
        if reread {
            return; // found closed, read why, and sent again
        }
    }
    panic!("no renewal reached the ledger before the old block expired, in 5 tries");
}

/// Three plans' accounts for one caller (5, 10 and 20 a minute), the first provisioned.
async fn plans_of_one_caller(ledger: &Ledger) -> (Limit, Limit, Limit) {
    let plans = (
        fresh_limit(5, 60, 1),
        fresh_limit(10, 60, 1),
        fresh_limit(20, 60, 1),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    ledger.provision(&plans.0.account, deadline).await.unwrap();
    plans
}

/// A move of an account another operator moved first says so (a 409 to look the caller up
/// again), where it said the caller was blocked, or failed as unexpected (a 503).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_of_an_account_moved_meanwhile_says_so() {
    use ledger_limiter::ledger::model::Actor;
    use ledger_limiter::ledger::Moving;
    let ledger = ledger_client(vec![shared_ledger().address]);
    let (free, pro, team) = plans_of_one_caller(&ledger).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let actor = Actor::from_reason(1, "test").unwrap();
    let id = free.account.id;
    let first = ledger
        .move_caller(id, &pro.account, 7, actor, 60, deadline)
        .await;
    assert_eq!(first, Ok(Moving::Done { carried: 0 }));
    let second = ledger
        .move_caller(id, &team.account, 8, actor, 60, deadline)
        .await;
    assert_eq!(second, Ok(Moving::MovedMeanwhile));
    // A blocked account still says blocked.
    ledger
        .block(pro.account.id, 60, actor, deadline)
        .await
        .unwrap();
    let blocked = (ledger.move_caller(pro.account.id, &team.account, 8, actor, 60, deadline)).await;
    assert_eq!(blocked, Ok(Moving::Closed));
}

/// Two operators moving one caller at once, to two plans: one move lands, the other is told the
/// caller moved meanwhile, whichever step it was at (its read, or its chain: the move transfer
/// on a closed account), never that the caller is blocked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_moves_at_once_land_one() {
    use ledger_limiter::ledger::model::Actor;
    use ledger_limiter::ledger::Moving;
    let ledger = ledger_client(vec![shared_ledger().address]);
    let (free, pro, team) = plans_of_one_caller(&ledger).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let actor = Actor::from_reason(1, "test").unwrap();
    let id = free.account.id;
    let (a, b) = tokio::join!(
        ledger.move_caller(id, &pro.account, 7, actor, 60, deadline),
        ledger.move_caller(id, &team.account, 8, actor, 60, deadline),
    );
    let mut answers = [a.unwrap(), b.unwrap()];
    answers.sort_by_key(|m| matches!(m, Moving::MovedMeanwhile));
    assert!(matches!(answers[0], Moving::Done { .. }), "{answers:?}");
    assert_eq!(answers[1], Moving::MovedMeanwhile);
}

/// Two operators moving a caller back at once: both chains begin with the void of the same
/// move; the one that loses was an unexpected ledger answer (a 503). It is told the caller
/// moved meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_moves_back_at_once_land_one() {
    use ledger_limiter::ledger::model::Actor;
    use ledger_limiter::ledger::Moving;
    let ledger = ledger_client(vec![shared_ledger().address]);
    let (free, pro) = (fresh_limit(5, 60, 1), fresh_limit(10, 60, 1));
    let deadline = Instant::now() + Duration::from_secs(10);
    ledger.provision(&free.account, deadline).await.unwrap();
    let actor = Actor::from_reason(1, "test").unwrap();
    let (from, to) = (free.account.id, pro.account.id);
    let up = ledger
        .move_caller(from, &pro.account, 7, actor, 60, deadline)
        .await;
    assert!(matches!(up, Ok(Moving::Done { .. })));
    let (a, b) = tokio::join!(
        ledger.move_caller(to, &free.account, 8, actor, 60, deadline),
        ledger.move_caller(to, &free.account, 8, actor, 60, deadline),
    );
    let mut answers = [a.unwrap(), b.unwrap()];
    answers.sort_by_key(|m| matches!(m, Moving::MovedMeanwhile));
    assert!(matches!(answers[0], Moving::Done { .. }), "{answers:?}");
    assert_eq!(answers[1], Moving::MovedMeanwhile);
}

/// An operator's block is most needed in a flood, when decisions fill the in-flight bound: it
/// waits for a place (within its deadline) instead of being refused `Overloaded` at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_action_waits_for_a_place_under_a_full_bound() {
    use ledger_limiter::ledger::model::Actor;
    use ledger_limiter::ledger::operator::Blocking;
    use ledger_limiter::ledger::{as_operator_action, Unblocking};
    let process = TestLedger::start();
    let full = full_bound(&process).await;
    let (ledger, id) = (&full.ledger, full.account.id);
    let actor = Actor::from_reason(1, "test").unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let resume = resume_after(&process, Duration::from_millis(300));
    let (blocked, ()) = tokio::join!(ledger.block(id, 600, actor, deadline), resume);
    assert!(matches!(blocked, Ok(Blocking::Done { .. })), "{blocked:?}");
    let _ = full.other.await;
    // An unblock reads the account first: within an operator's action, its reads wait too.
    let other = take_the_only_place(&process, ledger, id).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    let unblock = as_operator_action(ledger.unblock(id, actor, deadline));
    let resume = resume_after(&process, Duration::from_millis(300));
    let (unblocked, ()) = tokio::join!(unblock, resume);
    assert!(matches!(unblocked, Ok(Unblocking::Done)), "{unblocked:?}");
    let _ = other.await;
}

/// The admin API audits callers only: an account of another ledger (a concurrency limit's
/// slots, whose ids look like a caller's) is no caller, and was answered as one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_caller_of_this_ledger_is_audited_as_a_caller() {
    let ledger = ledger_client(vec![shared_ledger().address]);
    let slots = ledger.on_ledger(2);
    let limit = fresh_limit(2, 60, 1);
    let deadline = Instant::now() + Duration::from_secs(5);
    slots.provision(&limit.account, deadline).await.unwrap();
    let id = limit.account.id;
    assert!(ledger.audit(id, deadline).await.unwrap().is_some());
    assert!(slots.audit_caller(id, deadline).await.unwrap().is_some());
    assert!(ledger.audit_caller(id, deadline).await.unwrap().is_none());
    // Nor unblocked as one (it was "not blocked", and every instance told to forget).
    let actor = ledger_limiter::ledger::model::Actor::from_reason(1, "test").unwrap();
    let unblocked = ledger.unblock(id, actor, deadline).await;
    assert_eq!(
        unblocked,
        Ok(ledger_limiter::ledger::Unblocking::NoSuchAccount)
    );
}

/// Readiness waits for a place too: a burst that fills the in-flight bound on a healthy ledger
/// made `/readyz` answer 503 "too many ledger calls in flight", and an orchestrator take the
/// instance out of service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ping_waits_for_a_place_under_a_full_bound() {
    let pinged = under_a_full_bound(|ledger, deadline| async move { ledger.ping(deadline).await });
    assert_eq!(pinged.await, Ok(()));
}

/// `call` on a ledger handle whose one place is taken, the ledger stopped, and resumed 300 ms
/// later ([`full_bound`], [`resume_after`]): its answer, by a deadline 5 s away.
async fn under_a_full_bound<F: std::future::Future>(
    call: impl FnOnce(Arc<Ledger>, Instant) -> F,
) -> F::Output {
    let process = TestLedger::start();
    let full = full_bound(&process).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    let resume = resume_after(&process, Duration::from_millis(300));
    let (answer, ()) = tokio::join!(call(full.ledger.clone(), deadline), resume);
    let _ = full.other.await;
    answer
}

/// The operator epoch, which every instance reads each second to learn of an operator's act,
/// waits for a place too: refused `Overloaded` at once in a flood, a block reached no other
/// instance (leases admitted the blocked caller until their L was over) until the flood ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_epoch_is_read_under_a_full_bound() {
    let read = |ledger: Arc<Ledger>, deadline| async move { ledger.operator_epoch(deadline).await };
    let epoch = under_a_full_bound(read).await;
    assert!(epoch.is_ok(), "{epoch:?}");
}

/// A fresh caller's request of `cost`, admitted on `limiter`'s plan and a route limit of 10 a
/// minute; and the caller.
async fn admitted_beside_a_route_limit(
    limiter: &Limiter,
    cost: u64,
) -> (
    ledger_limiter::limiter::Decision<'_>,
    ledger_limiter::limiter::caller::CallerKey,
) {
    let route = Plan::new(
        "burst",
        NonZeroU64::new(10).unwrap(),
        NonZeroU32::new(60).unwrap(),
    )
    .unwrap();
    let key = caller(&fresh_key("k_"));
    let cost = NonZeroU64::new(cost).unwrap();
    let checked = limiter.check_with(&key, cost, std::slice::from_ref(&route));
    let (decision, _) = checked.await.unwrap();
    assert_eq!(decision.outcome, Outcome::Admitted);
    (decision, key)
}

/// A refund after a recharge gives back what the recharge held, on the plan and the route
/// limit: it voided the estimates' holds, which the recharge had voided already (a second void
/// of a transfer is refused), and left the caller charged the actual cost for its window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_after_a_recharge_gives_back_what_the_recharge_held() {
    let limiter = limiter(ledger_client(vec![shared_ledger().address]));
    let (mut decision, key) = admitted_beside_a_route_limit(&limiter, 1).await;
    let done = limiter.recharge(&mut decision, 3).await.unwrap();
    assert_eq!(done, [true, true], "both holds recharged");
    assert_eq!(decision.quota.remaining, 2, "5 less the 3 it cost");
    assert!(limiter.refund(&mut decision).await.unwrap(), "given back");
    assert_eq!(decision.quota.remaining, 5, "{decision:?}");
    assert_eq!(decision.route_limits[0].quota.remaining, 10);
    let deadline = Instant::now() + Duration::from_secs(5);
    let ledger = limiter.ledger();
    for account_id in [decision.account_id, decision.route_limits[0].account_id] {
        let audit = ledger.audit(account_id, deadline).await.unwrap().unwrap();
        assert_eq!(audit.debits_pending, 0, "nothing held: {audit:?}");
        assert_eq!((audit.holds, audit.voids), (2, 2), "{audit:?}");
    }
    // Nothing held, so a whole quota admits again.
    let whole = NonZeroU64::new(5).unwrap();
    let (again, _) = limiter.check_with(&key, whole, &[]).await.unwrap();
    assert_eq!(again.outcome, Outcome::Admitted);
}

/// A recharge whose one linked chain fails (an operator blocked one of the request's limits
/// meanwhile) recharges each hold alone, so that the others still are: the plan's hold is
/// replaced by one of the actual cost, and the blocked limit's estimate stands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recharge_whose_chain_fails_recharges_each_hold_alone() {
    use ledger_limiter::ledger::model::Actor;
    let limiter = limiter(ledger_client(vec![shared_ledger().address]));
    let (mut decision, _) = admitted_beside_a_route_limit(&limiter, 2).await;
    let route_account = decision.route_limits[0].account_id;
    let deadline = Instant::now() + Duration::from_secs(5);
    let actor = Actor::from_reason(1, "test").unwrap();
    let ledger = limiter.ledger();
    ledger
        .block(route_account, 600, actor, deadline)
        .await
        .unwrap();
    let done = limiter.recharge(&mut decision, 1).await.unwrap();
    assert_eq!(
        done,
        [true, false],
        "the plan's alone, the blocked limit's not"
    );
    let plan = ledger.audit(decision.account_id, deadline).await.unwrap();
    let plan = plan.unwrap();
    assert_eq!((plan.holds, plan.voids), (2, 1), "recharged: {plan:?}");
    assert_eq!(plan.debits_pending, 1, "the actual cost: {plan:?}");
    let blocked = ledger
        .audit(route_account, deadline)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((blocked.holds, blocked.voids), (1, 0), "{blocked:?}");
}
