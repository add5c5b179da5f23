//! [`Limiter::check_all`] through the seams: every branch of a decision against several limits.
//! `tests/chain.rs` is the proof against a real TigerBeetle.

use std::num::NonZeroU32;

use super::*;
use crate::ledger::LinkRefusal;
use crate::limiter::multi::{Limit, LimitsError, LIMITS_PER_CHECK_MAX};

fn limit(id: u128, capacity: u64, window_s: u32, cost: u64) -> Limit {
    Limit {
        account: UserAccount {
            id,
            capacity: NonZeroU64::new(capacity).unwrap(),
            window_seconds: NonZeroU32::new(window_s).unwrap(),
        },
        cost,
        local_view: true,
        lease: None,
    }
}

const A: u128 = 1 << 127 | 1;
const B: u128 = 1 << 127 | 2;

fn held(f: &Fixture, ids: &[u128]) -> Reply<ChainReply> {
    Ok(ChainReply::Held {
        roundtrip: Roundtrip::at(f.clock.now()),
        transfer_ids: ids.to_vec(),
    })
}

fn refused(index: usize, refusal: LinkRefusal) -> Reply<ChainReply> {
    Ok(ChainReply::Refused { index, refusal })
}

fn chains(f: &Fixture) -> Vec<Vec<(u128, u64)>> {
    let mut script = f.limiter.store.0.lock().unwrap();
    std::mem::take(&mut script.chain_links)
        .into_iter()
        .map(|c| c.iter().map(|l| (l.account_id, l.amount)).collect())
        .collect()
}

#[tokio::test]
async fn every_costing_limit_is_one_link_of_one_chain() {
    let f = Fixture::closed();
    let answer = held(&f, &[7, 8]);
    f.script(|s| s.chains.push_back(answer));
    let limits = [limit(A, 5, 60, 2), limit(B, 10, 3600, 1)];
    let decision = f.limiter.check_all(&limits).await.unwrap();
    assert_eq!(decision.outcome, Outcome::Admitted);
    assert_eq!(decision.refused_by, None);
    assert_eq!(f.calls(), ["chain"]);
    assert_eq!(chains(&f), [vec![(A, 2), (B, 1)]]);
    let [a, b] = [decision.limits[0], decision.limits[1]];
    assert_eq!(
        (a.quota.limit, a.quota.remaining, a.quota.reset_seconds),
        (5, 3, 60)
    );
    assert_eq!(
        (b.quota.limit, b.quota.remaining, b.quota.window_seconds),
        (10, 9, 3600)
    );
    assert_eq!(a.hold.map(|h| (h.transfer_id, h.amount)), Some((7, 2)));
    assert_eq!(b.hold.map(|h| h.transfer_id), Some(8));
    f.script(|s| assert_eq!(s.void_if_abandoned, [true]));
}

#[tokio::test]
async fn a_check_holds_nothing_and_is_refused_when_nothing_is_free() {
    let f = Fixture::closed();
    // A check (cost 0) beside a charge: the check's account is looked up (its holds are not
    // listed), the charge is the chain.
    let answer = held(&f, &[7]);
    let two_free = f.view(5, &[30, 30, 30], true);
    f.script(|s| {
        s.views.push_back(Ok(Some(two_free)));
        s.chains.push_back(answer);
    });
    let decision = f
        .limiter
        .check_all(&[limit(A, 5, 60, 0), limit(B, 5, 60, 1)])
        .await
        .unwrap();
    assert_eq!(decision.outcome, Outcome::Admitted);
    assert_eq!(f.calls(), ["free", "chain"]);
    assert_eq!(chains(&f), [vec![(B, 1)]]);
    assert_eq!(decision.limits[0].hold, None);
    assert_eq!(decision.limits[0].quota.remaining, 2, "the ledger's word");
    // A caller the ledger has never seen is whole; no limits at all: no ledger call.
    f.script(|s| s.views.push_back(Ok(None)));
    let decision = f.limiter.check_all(&[limit(A, 5, 60, 0)]).await.unwrap();
    assert_eq!(decision.outcome, Outcome::Admitted);
    assert_eq!(decision.limits[0].quota.remaining, 5);
    let decision = f.limiter.check_all(&[]).await.unwrap();
    assert_eq!(decision.outcome, Outcome::Admitted);
    assert_eq!(f.calls(), ["free"]);
    // Nothing free: refused, retry when the first hold ends (its holds listed for that); then
    // from memory.
    let spent = f.view(3, &[20, 30, 30], true);
    f.script(|s| {
        s.views.push_back(Ok(Some(spent.clone())));
        s.views.push_back(Ok(Some(spent)));
    });
    let checks = [limit(A, 5, 60, 0), limit(B, 5, 60, 1)];
    let decision = f.limiter.check_all(&checks).await.unwrap();
    assert_eq!(
        limited_by_outcome(&decision.outcome),
        Some((20, DecisionSource::Ledger))
    );
    assert_eq!(decision.refused_by, Some(0));
    assert_eq!(f.calls(), ["free", "view"], "nothing charged beside it");
    let decision = f.limiter.check_all(&checks).await.unwrap();
    assert_eq!(
        limited_by_outcome(&decision.outcome),
        Some((20, DecisionSource::LocalView))
    );
    assert!(f.calls().is_empty());
}

#[tokio::test]
async fn an_exhausted_limit_is_refused_locally_and_the_others_are_untouched() {
    let f = Fixture::closed();
    for ids in [[1, 2], [3, 4]] {
        let answer = held(&f, &ids);
        f.script(|s| s.chains.push_back(answer));
        let decision = f
            .limiter
            .check_all(&[limit(A, 5, 60, 1), limit(B, 2, 30, 1)])
            .await
            .unwrap();
        assert_eq!(decision.outcome, Outcome::Admitted);
    }
    f.calls();
    // The ledger refuses first (the local view refuses only on its recent word).
    let full = f.view(2, &[30, 30], true);
    f.script(|s| {
        s.chains.push_back(refused(1, LinkRefusal::ExceedsCredits));
        s.views.push_back(Ok(Some(full)));
    });
    let limits = [limit(A, 5, 60, 1), limit(B, 2, 30, 1)];
    let decision = f.limiter.check_all(&limits).await.unwrap();
    assert_eq!(
        limited_by_outcome(&decision.outcome),
        Some((30, DecisionSource::Ledger))
    );
    assert_eq!(f.calls(), ["chain", "view"]);
    let decision = f.limiter.check_all(&limits).await.unwrap();
    assert_eq!(
        limited_by_outcome(&decision.outcome),
        Some((30, DecisionSource::LocalView))
    );
    assert_eq!(decision.refused_by, Some(1));
    assert!(f.calls().is_empty(), "a local refusal makes no ledger call");
    assert_eq!(decision.limits[0].quota.remaining, 3, "A did not move");
    assert_eq!(decision.limits[1].quota.remaining, 0);
}

/// Admitted, both say what the account has left after both holds (the first said one unit more).
#[tokio::test]
async fn two_limits_on_one_account_say_what_is_left_after_both() {
    let f = Fixture::closed();
    let answer = held(&f, &[1, 2]);
    f.script(|s| s.chains.push_back(answer));
    let limits = [limit(A, 5, 60, 1), limit(A, 5, 60, 2)];
    let decision = f.limiter.check_all(&limits).await.unwrap();
    assert_eq!(decision.outcome, Outcome::Admitted);
    let left: Vec<u64> = decision.limits.iter().map(|l| l.quota.remaining).collect();
    assert_eq!(left, [2, 2]);
    // Without a local view: the capacity less both costs.
    let unviewed = limits.map(|limit| Limit {
        local_view: false,
        ..limit
    });
    let answer = held(&f, &[3, 4]);
    f.script(|s| s.chains.push_back(answer));
    let decision = f.limiter.check_all(&unviewed).await.unwrap();
    let left: Vec<u64> = decision.limits.iter().map(|l| l.quota.remaining).collect();
    assert_eq!(left, [2, 2]);
}

#[tokio::test]
async fn two_limits_on_one_account_are_refused_locally_on_their_sum() {
    let f = Fixture::closed();
    let answer = held(&f, &[1]);
    f.script(|s| s.chains.push_back(answer));
    f.limiter.check_all(&[limit(A, 5, 60, 3)]).await.unwrap();
    let held_three = f.view(5, &[60, 60, 60], true);
    f.script(|s| {
        s.chains.push_back(refused(0, LinkRefusal::ExceedsCredits));
        s.views.push_back(Ok(Some(held_three)));
    });
    let limits = [limit(A, 5, 60, 1), limit(A, 5, 60, 2)];
    let decision = f.limiter.check_all(&limits).await.unwrap();
    assert_eq!(decision.refused_by, Some(0));
    assert_eq!(f.calls(), ["chain", "chain", "view"]);
    let decision = f.limiter.check_all(&limits).await.unwrap();
    assert_eq!(decision.refused_by, Some(0));
    assert!(
        f.calls().is_empty(),
        "refused locally on the sum of the two costs"
    );
}

#[tokio::test]
async fn each_new_account_is_provisioned_once_then_the_chain_placed_again() {
    let f = Fixture::closed();
    let answer = held(&f, &[1, 2]);
    f.script(|s| {
        s.chains.extend([
            refused(0, LinkRefusal::AccountNotFound),
            refused(1, LinkRefusal::AccountNotFound),
            answer,
        ]);
        s.provisions.extend([Ok(()), Ok(())]);
    });
    let limits = [limit(A, 5, 60, 1), limit(B, 5, 60, 1)];
    let decision = f.limiter.check_all(&limits).await.unwrap();
    assert_eq!(decision.outcome, Outcome::Admitted);
    assert_eq!(
        f.calls(),
        ["chain", "provision", "chain", "provision", "chain"]
    );
}

#[tokio::test]
async fn an_account_missing_after_provisioning_follows_the_failure_policy() {
    let f = Fixture::closed();
    f.script(|s| {
        s.chains.extend([
            refused(1, LinkRefusal::AccountNotFound),
            refused(1, LinkRefusal::AccountNotFound),
        ]);
        s.provisions.push_back(Ok(()));
    });
    let limits = [limit(A, 5, 60, 1), limit(B, 5, 60, 1)];
    let decision = f.limiter.check_all(&limits).await.unwrap();
    assert!(matches!(
        decision.outcome,
        Outcome::FailedClosed(LedgerError::Unexpected { .. })
    ));
    assert_eq!(decision.refused_by, None);
    f.script(|s| assert_eq!(s.errors_recorded, 1));
}

/// Limits A (20 a minute) and B (`CAPACITY` per 30 s), B refused by the ledger, whose listing
/// has it full (holds ending in 7 to 12 s): `f`'s decision, and the limits.
async fn refused_by_b_listed_full(f: &Fixture) -> (MultiDecision, [Limit; 2]) {
    let full = f.view(CAPACITY, &[7, 8, 9, 10, 12], true);
    f.script(|s| {
        s.chains.push_back(refused(1, LinkRefusal::ExceedsCredits));
        s.views.push_back(Ok(Some(full)));
    });
    let limits = [limit(A, 20, 60, 1), limit(B, CAPACITY, 30, 1)];
    (f.limiter.check_all(&limits).await.unwrap(), limits)
}

#[tokio::test]
async fn a_refusal_by_the_ledger_names_the_limit_and_its_retry_after() {
    let f = Fixture::closed();
    let (decision, limits) = refused_by_b_listed_full(&f).await;
    assert_eq!(
        limited_by_outcome(&decision.outcome),
        Some((7, DecisionSource::Ledger))
    );
    assert_eq!(decision.refused_by, Some(1));
    assert_eq!(decision.limits[1].quota.remaining, 0);
    assert_eq!(decision.limits[0].quota.remaining, 20, "nothing held on A");
    assert!(decision.limits.iter().all(|l| l.hold.is_none()));
    assert_eq!(f.calls(), ["chain", "view"]);
    // Remembered: the next request is refused by B without a call.
    let again = f.limiter.check_all(&limits).await.unwrap();
    assert_eq!(again.refused_by, Some(1));
    assert!(f.calls().is_empty());
}

/// A refusal whose listing gives no instant to wait for (the view off here; or the listing
/// found room again) says `Retry-After: 1`, and its limit's reset is no sooner: it said `t=0`.
#[tokio::test]
async fn a_refusal_with_no_instant_to_wait_for_resets_no_sooner_than_it_retries() {
    let f = Fixture::with_view(0);
    let (decision, _) = refused_by_b_listed_full(&f).await;
    let (retry_after_seconds, _) = limited_by_outcome(&decision.outcome).expect("limited");
    assert_eq!(decision.refused_by, Some(1));
    assert!(retry_after_seconds >= 1);
    let reset_seconds = decision.limits[1].quota.reset_seconds;
    assert!(
        reset_seconds >= retry_after_seconds,
        "t={reset_seconds} under Retry-After: {retry_after_seconds}"
    );
}

/// A costly request refused by the ledger says what is left (2 of 5, under its cost of 3), as
/// a refusal from memory does: not 0.
#[tokio::test]
async fn a_refusal_by_the_ledger_says_what_is_left_under_the_cost() {
    let f = Fixture::closed();
    let three_held = f.view(CAPACITY, &[7, 8, 9], true);
    f.script(|s| {
        s.chains.push_back(refused(1, LinkRefusal::ExceedsCredits));
        s.views.push_back(Ok(Some(three_held)));
    });
    let limits = [limit(A, 20, 60, 3), limit(B, CAPACITY, 30, 3)];
    let decision = f.limiter.check_all(&limits).await.unwrap();
    assert_eq!(decision.refused_by, Some(1));
    assert_eq!(decision.limits[1].quota.remaining, 2, "by the ledger");
    // Blocked, nothing is left to say.
    let blocked = AccountView {
        blocked: Some(Blocked {
            until: Some(f.clock.wall() + Duration::from_secs(600)),
            moved_to: None,
        }),
        ..f.view(CAPACITY, &[7, 8, 9], true)
    };
    let g = Fixture::closed();
    g.script(|s| {
        s.chains.push_back(refused(1, LinkRefusal::ExceedsCredits));
        s.views.push_back(Ok(Some(blocked)));
    });
    let decision = g.limiter.check_all(&limits).await.unwrap();
    assert_eq!(decision.refused_by, Some(1));
    assert_eq!(decision.limits[1].quota.remaining, 0, "blocked");
}

/// The chain stops at its first link without credit; the limits after it are read too, and the
/// refusal is the one that comes back last (then from memory too).
#[tokio::test]
async fn a_refusal_waits_for_the_limit_that_comes_back_last() {
    let f = Fixture::closed();
    let soon = f.view(2, &[2, 3], true);
    let late = f.view(2, &[40, 50], true);
    f.script(|s| {
        s.chains.push_back(refused(0, LinkRefusal::ExceedsCredits));
        s.views
            .extend([Ok(Some(soon)), Ok(Some(late.clone())), Ok(Some(late))]);
    });
    let limits = [limit(A, 2, 3, 1), limit(B, 2, 60, 1)];
    for source in [DecisionSource::Ledger, DecisionSource::LocalView] {
        let decision = f.limiter.check_all(&limits).await.unwrap();
        assert_eq!(limited_by_outcome(&decision.outcome), Some((40, source)));
        assert_eq!(decision.refused_by, Some(1));
        assert_eq!(decision.limits[1].quota.remaining, 0);
        assert!(decision.limits[1].quota.reset_seconds >= 40);
    }
    assert_eq!(f.calls(), ["chain", "view", "free", "view"]);
}

#[tokio::test]
async fn a_lease_plans_refusal_waits_for_other_instances_leases_to_settle_not_to_expire() {
    // Another instance leased all of the plan's credit at `wall`: its lease times out after
    // window + L (60 + 2 s), but that instance settles it about L after.
    let f = Fixture::closed();
    let terms = crate::limiter::plan::LeaseTerms {
        units_max: NonZeroU64::new(CAPACITY).unwrap(),
        seconds: NonZeroU32::new(2).unwrap(),
    };
    let wall = f.clock.wall();
    let leased = AccountView {
        holds: vec![Hold {
            id: 1,
            amount: CAPACITY,
            expires_at: wall + Duration::from_secs(62),
            leased_at: Some(wall),
        }],
        available: 0,
        ..f.view(CAPACITY, &[], true)
    };
    // B, after the refused link, is looked up too (it has room).
    let other = f.view(20, &[], true);
    f.script(|s| {
        s.chains.push_back(refused(0, LinkRefusal::ExceedsCredits));
        s.views.extend([Ok(Some(leased)), Ok(Some(other))]);
    });
    let plan = Limit {
        lease: Some(terms),
        ..limit(A, CAPACITY, 60, 1)
    };
    let limits = [plan, limit(B, 20, 1, 1)];
    let decision = f.limiter.check_all(&limits).await.unwrap();
    let (retry_after_seconds, _) = limited_by_outcome(&decision.outcome).expect("limited");
    assert!(
        retry_after_seconds <= 3,
        "L and a sweep, not 62 s: {retry_after_seconds}"
    );
    assert_eq!(f.calls(), ["chain", "view", "free"]);
    // Past that, the local view does not refuse the caller from memory.
    f.clock.advance(Duration::from_secs(4));
    let held = held(&f, &[1, 2]);
    f.script(|s| s.chains.push_back(held));
    let admitted = f.limiter.check_all(&limits).await.unwrap();
    assert_eq!(admitted.outcome, Outcome::Admitted);
    assert_eq!(f.calls(), ["chain"]);
}

#[tokio::test]
async fn the_second_look_places_the_chain_once_more() {
    // Credit back between the calls; a racing provisioning (no grant yet); a second refusal.
    let f = Fixture::closed();
    let limits = [limit(A, 20, 60, 1), limit(B, CAPACITY, 30, 1)];
    let back = f.view(CAPACITY, &[10], true);
    let answer = held(&f, &[1, 2]);
    f.script(|s| {
        s.chains
            .extend([refused(1, LinkRefusal::ExceedsCredits), answer]);
        s.views.push_back(Ok(Some(back)));
    });
    assert_eq!(
        f.limiter.check_all(&limits).await.unwrap().outcome,
        Outcome::Admitted
    );
    assert_eq!(f.calls(), ["chain", "view", "chain"]);

    let f = Fixture::closed();
    let ungranted = f.view(0, &[], true);
    let answer = held(&f, &[1, 2]);
    f.script(|s| {
        s.chains
            .extend([refused(0, LinkRefusal::ExceedsCredits), answer]);
        s.views.push_back(Ok(Some(ungranted)));
        s.provisions.push_back(Ok(()));
    });
    assert_eq!(
        f.limiter.check_all(&limits).await.unwrap().outcome,
        Outcome::Admitted
    );
    assert_eq!(f.calls(), ["chain", "view", "provision", "chain"]);

    let f = Fixture::closed();
    let back = f.view(CAPACITY, &[10], true);
    let full = f.view(CAPACITY, &[3, 4, 5, 6, 7], true);
    f.script(|s| {
        s.chains.extend([
            refused(1, LinkRefusal::ExceedsCredits),
            refused(1, LinkRefusal::ExceedsCredits),
        ]);
        s.views.extend([Ok(Some(back)), Ok(Some(full))]);
    });
    let decision = f.limiter.check_all(&limits).await.unwrap();
    assert_eq!(
        limited_by_outcome(&decision.outcome),
        Some((3, DecisionSource::Ledger))
    );
    assert_eq!(f.calls(), ["chain", "view", "chain", "view"]);
}

#[tokio::test]
async fn ledger_errors_follow_the_failure_policy_for_every_limit() {
    for (policy, void) in [(FailurePolicy::Closed, true), (FailurePolicy::Open, false)] {
        let f = Fixture::new(policy, UnknownKeys::DefaultPlan);
        f.script(|s| s.chains.push_back(Err(timeout())));
        let limits = [limit(A, 5, 60, 1), limit(B, 5, 60, 1)];
        let decision = f.limiter.check_all(&limits).await.unwrap();
        let expected = match policy {
            FailurePolicy::Closed => Outcome::FailedClosed(timeout()),
            FailurePolicy::Open => Outcome::FailedOpen(timeout()),
        };
        assert_eq!(decision.outcome, expected);
        assert!(decision.limits.iter().all(|l| l.quota.remaining == 5));
        f.script(|s| assert_eq!(s.void_if_abandoned, [void]));
    }
}

#[tokio::test]
async fn a_limit_without_local_view_always_asks_the_ledger() {
    let f = Fixture::closed();
    let slot = Limit {
        local_view: false,
        ..limit(A, 1, 60, 1)
    };
    let answer = held(&f, &[1]);
    f.script(|s| {
        s.chains
            .extend([answer, refused(0, LinkRefusal::ExceedsCredits)]);
        s.views.push_back(Ok(Some(f.view(1, &[50], true))));
    });
    let first = f.limiter.check_all(&[slot]).await.unwrap();
    assert_eq!(first.outcome, Outcome::Admitted);
    assert_eq!(first.limits[0].quota.remaining, 0);
    let second = f.limiter.check_all(&[slot]).await.unwrap();
    assert_eq!(second.refused_by, Some(0));
    // A slot comes back when any call in flight ends: a second, not its window (60 s).
    assert!(
        matches!(
            second.outcome,
            Outcome::Limited {
                retry_after_seconds: 1,
                ..
            }
        ),
        "{:?}",
        second.outcome
    );
    // Its refusal is read with one lookup: a listing would not be kept (an Envoy concurrency
    // rule's, before, was listed and thrown away on every refusal).
    assert_eq!(f.calls(), ["chain", "chain", "free"]);
}

#[tokio::test]
async fn too_many_or_inconsistent_limits_are_refused_before_any_call() {
    let f = Fixture::closed();
    let many: Vec<Limit> = (0..=LIMITS_PER_CHECK_MAX as u128)
        .map(|i| limit(A + 2 * i, 5, 60, 1))
        .collect();
    assert_eq!(
        f.limiter.check_all(&many).await,
        Err(LimitsError::TooMany(LIMITS_PER_CHECK_MAX + 1))
    );
    let clash = [limit(A, 5, 60, 1), limit(A, 6, 60, 1)];
    assert_eq!(
        f.limiter.check_all(&clash).await,
        Err(LimitsError::Inconsistent)
    );
    assert!(f.calls().is_empty());
}

fn limited_by_outcome(outcome: &Outcome) -> Option<(u64, DecisionSource)> {
    match outcome {
        Outcome::Limited {
            retry_after_seconds,
            source,
        } => Some((*retry_after_seconds, *source)),
        _ => None,
    }
}

/// A new caller races other requests on every limit's account: each account whose grant has not
/// landed yet is finished once, not only the first one (a refusal by a limit with all its credit
/// free would be wrong).
#[tokio::test]
async fn every_racing_provisioning_is_finished_not_only_the_first() {
    let f = Fixture::closed();
    let ungranted = f.view(0, &[], true);
    let answer = held(&f, &[1, 2]);
    f.script(|s| {
        s.chains.extend([
            refused(0, LinkRefusal::ExceedsCredits),
            refused(1, LinkRefusal::ExceedsCredits),
            answer,
        ]);
        s.views
            .extend([Ok(Some(ungranted.clone())), Ok(Some(ungranted))]);
        s.provisions.extend([Ok(()), Ok(())]);
    });
    let limits = [limit(A, 5, 60, 1), limit(B, 5, 60, 1)];
    let decision = f.limiter.check_all(&limits).await.unwrap();
    assert_eq!(decision.outcome, Outcome::Admitted);
    assert_eq!(
        f.calls(),
        [
            "chain",
            "view",
            "provision",
            "chain",
            "view",
            "provision",
            "chain"
        ]
    );
}

/// Each account gets its own second look: a grant landing (or credit coming back) on one limit
/// between the chain and the look does not use up the look another limit needs.
#[tokio::test]
async fn each_limit_gets_its_own_second_look() {
    let f = Fixture::closed();
    let free = f.view(5, &[], true);
    let answer = held(&f, &[1, 2]);
    f.script(|s| {
        s.chains.extend([
            refused(0, LinkRefusal::ExceedsCredits),
            refused(1, LinkRefusal::ExceedsCredits),
            answer,
        ]);
        s.views.extend([Ok(Some(free.clone())), Ok(Some(free))]);
    });
    let limits = [limit(A, 5, 60, 1), limit(B, 5, 60, 1)];
    let decision = f.limiter.check_all(&limits).await.unwrap();
    assert_eq!(decision.outcome, Outcome::Admitted);
    assert_eq!(f.calls(), ["chain", "view", "chain", "view", "chain"]);
}

#[tokio::test]
async fn an_unknown_account_is_learnt_from_the_ledger_after_an_admission() {
    let f = Fixture::closed();
    let limits = [limit(A, CAPACITY, 30, 1)];
    let unknown = f.limiter.unknown_limits(&limits);
    assert_eq!(unknown, [true]);
    let answer = held(&f, &[1]);
    // Another instance (or this one before a restart) placed three holds; ours is the fourth.
    let ledger = f.view(CAPACITY, &[5, 10, 20, 30], true);
    f.script(|s| {
        s.chains.push_back(answer);
        s.views.push_back(Ok(Some(ledger)));
    });
    let mut decision = f.limiter.check_all(&limits).await.unwrap();
    assert_eq!(decision.limits[0].quota.remaining, CAPACITY - 1, "a guess");
    let deadline = f.clock.now() + Duration::from_secs(1);
    f.limiter
        .learn(&limits, &unknown, &mut decision, deadline)
        .await;
    assert_eq!(decision.limits[0].quota.remaining, 1, "the ledger's");
    assert_eq!(f.calls(), ["chain", "view"]);
    assert_eq!(f.limiter.unknown_limits(&limits), [false]);
    // Forgotten (its holds were given back by amount): unknown again, asked again.
    f.limiter.forget(A);
    assert_eq!(f.limiter.unknown_limits(&limits), [true]);
    // Past the decision's deadline, nothing is read.
    let mut late = decision.clone();
    f.limiter
        .learn(&limits, &[true], &mut late, f.clock.now())
        .await;
    assert!(f.calls().is_empty());
}

/// A link's account is closed (a block, a move) and the read of why fails: refused under either
/// policy (the ledger said no; a failure would be let through by an Envoy that fails open), for
/// a second, not the longest window.
#[tokio::test]
async fn a_closed_link_whose_read_fails_is_refused_for_a_second_under_either_policy() {
    let f = Fixture::new(FailurePolicy::Open, UnknownKeys::DefaultPlan);
    f.script(|s| {
        s.chains.push_back(refused(1, LinkRefusal::Closed));
        s.views.push_back(Err(timeout()));
    });
    let limits = [limit(A, 5, 60, 1), limit(B, 10, 3600, 1)];
    let decision = f.limiter.check_all(&limits).await.unwrap();
    let retry = match decision.outcome {
        Outcome::Limited {
            retry_after_seconds,
            source: DecisionSource::Ledger,
        } => retry_after_seconds,
        other => panic!("{other:?}"),
    };
    assert_eq!((retry, decision.refused_by), (1, Some(1)));
    assert_eq!(decision.limits[1].quota.remaining, 0);
    // Not `t=0` (whole now) beside the retry: the view knows nothing of the account.
    assert_eq!(decision.limits[1].quota.reset_seconds, 1);
    assert_eq!(f.calls(), ["chain", "view"]);
}

/// A link whose account holds more than a listing reads, refused by the ledger again within a
/// second of its last listing: refused for a second without listing it again.
#[tokio::test]
async fn a_link_listed_incomplete_a_moment_ago_is_not_listed_again() {
    let f = Fixture::closed();
    let limits = [limit(A, 5, 60, 1), limit(B, 5, 30, 1)];
    let partial = f.view(5, &[20, 20], false);
    f.script(|s| {
        s.chains.push_back(refused(1, LinkRefusal::ExceedsCredits));
        s.views.push_back(Ok(Some(partial)));
    });
    let decision = f.limiter.check_all(&limits).await.unwrap();
    assert_eq!(
        limited_by_outcome(&decision.outcome),
        Some((1, DecisionSource::Ledger))
    );
    assert_eq!(f.calls(), ["chain", "view"]);
    f.clock.advance(Duration::from_millis(500));
    f.script(|s| s.chains.push_back(refused(1, LinkRefusal::ExceedsCredits)));
    let decision = f.limiter.check_all(&limits).await.unwrap();
    assert_eq!(
        limited_by_outcome(&decision.outcome),
        Some((1, DecisionSource::Ledger))
    );
    assert_eq!(decision.refused_by, Some(1));
    assert_eq!(decision.limits[1].quota.remaining, 0);
    assert_eq!(f.calls(), ["chain"], "not listed again");
}

/// A check whose lookup found nothing free, and whose listing (for `Retry-After`) then failed:
/// the ledger said no a moment ago, so refused for a second whatever the policy, not admitted
/// by an open one.
#[tokio::test]
async fn a_refused_check_whose_listing_fails_is_refused_for_a_second() {
    let f = Fixture::new(FailurePolicy::Open, UnknownKeys::DefaultPlan);
    let spent = f.view(3, &[20, 30, 30], true);
    f.script(|s| {
        s.views.push_back(Ok(Some(spent)));
        s.views.push_back(Err(timeout()));
    });
    let decision = f.limiter.check_all(&[limit(A, 5, 60, 0)]).await.unwrap();
    assert_eq!(
        limited_by_outcome(&decision.outcome),
        Some((1, DecisionSource::Ledger))
    );
    assert_eq!(f.calls(), ["free", "view"]);
}

/// A check on an account listed a moment ago and found holding more than a listing reads: when
/// its lookup finds nothing free, refused for a second without listing it again.
#[tokio::test]
async fn a_refused_check_on_an_account_listed_incomplete_lists_nothing() {
    let f = Fixture::closed();
    let partial = f.view(5, &[20, 20], false);
    f.script(|s| {
        s.chains.push_back(refused(0, LinkRefusal::ExceedsCredits));
        s.views.push_back(Ok(Some(partial.clone())));
    });
    f.limiter.check_all(&[limit(A, 5, 60, 1)]).await.unwrap();
    assert_eq!(f.calls(), ["chain", "view"]);
    f.script(|s| s.views.push_back(Ok(Some(partial))));
    let decision = f.limiter.check_all(&[limit(A, 5, 60, 0)]).await.unwrap();
    assert_eq!(
        limited_by_outcome(&decision.outcome),
        Some((1, DecisionSource::Ledger))
    );
    assert_eq!(f.calls(), ["free"], "no listing");
    // Closed since (a block): read for why, whatever the listing a moment ago; refused as
    // blocked, until the block ends.
    let blocked = AccountView {
        blocked: Some(Blocked {
            until: Some(f.clock.wall() + Duration::from_secs(600)),
            moved_to: None,
        }),
        ..f.view(5, &[], true)
    };
    f.script(|s| {
        s.views.push_back(Ok(Some(blocked.clone())));
        s.views.push_back(Ok(Some(blocked)));
    });
    let decision = f.limiter.check_all(&[limit(A, 5, 60, 0)]).await.unwrap();
    assert!(
        matches!(decision.outcome, Outcome::Blocked { .. }),
        "{:?}",
        decision.outcome
    );
    assert_eq!(f.calls(), ["free", "view"]);
}

/// Two checks (Envoy's `hits_addend` 0): one account's read fails, the other's finds nothing
/// free. The ledger's refusal wins: the failed read made the call the failure policy's, admitted
/// under the open policy although the ledger had said no.
#[tokio::test]
async fn a_refused_check_outranks_a_failed_read_beside_it() {
    let f = Fixture::new(FailurePolicy::Open, UnknownKeys::DefaultPlan);
    let spent = f.view(3, &[20, 30, 30], true);
    f.script(|s| {
        s.views.push_back(Err(timeout()));
        s.views.push_back(Ok(Some(spent.clone())));
        s.views.push_back(Ok(Some(spent)));
    });
    let checks = [limit(A, 5, 60, 0), limit(B, 5, 60, 0)];
    let decision = f.limiter.check_all(&checks).await.unwrap();
    assert_eq!(decision.refused_by, Some(1), "{:?}", decision.outcome);
    assert_eq!(
        limited_by_outcome(&decision.outcome),
        Some((20, DecisionSource::Ledger))
    );
}

/// A caller this instance knows is blocked, refused while the ledger is down: its fields say
/// nothing is free until the block ends, as any refusal's. Before, the view's quota of the
/// caller (forgotten when the block was learnt) said `r=5;t=0`, before its Retry-After.
#[tokio::test]
async fn a_known_block_refused_while_the_ledger_fails_says_nothing_is_free() {
    let f = Fixture::closed();
    let until = f.clock.now() + Duration::from_secs(600);
    f.limiter
        .forget_acted_on(A, crate::limiter::local_view::BlockAct::Blocked(until));
    f.script(|s| s.chains.push_back(Err(timeout())));
    let limits = [limit(A, 5, 60, 1), limit(B, 10, 60, 1)];
    let decision = f.limiter.check_all(&limits).await.unwrap();
    let Outcome::Blocked {
        retry_after_seconds,
        ..
    } = decision.outcome
    else {
        panic!("blocked: {:?}", decision.outcome);
    };
    assert_eq!(decision.refused_by, Some(0));
    assert_eq!(f.calls(), ["chain"], "asked the ledger first");
    let quota = decision.limits[0].quota;
    assert_eq!(quota.remaining, 0, "{quota:?}");
    assert!(quota.reset_seconds >= retry_after_seconds, "{quota:?}");
    assert_eq!(
        decision.limits[1].quota.remaining, 10,
        "the other limit's own"
    );
}

/// A limit refused on a word of the ledger's over `LISTING_TRUSTED_FOR` old is listed again
/// before the request is refused: still short, refused on that word (the ledger's, with its
/// `Retry-After`); the listing failed, refused on the old word; with room (a hold voided on
/// another instance, which the old listing counted), the chain is placed. Before, the old
/// listing refused until its holds ended.
#[tokio::test]
async fn a_limit_refused_on_an_old_word_is_listed_again_first() {
    use crate::limiter::local_view::LISTING_TRUSTED_FOR;
    let f = Fixture::closed();
    let limits = [limit(A, 5, 60, 1), limit(B, 2, 30, 1)];
    let check = || f.limiter.check_all(&limits);
    let full = f.view(2, &[30, 30], true);
    f.script(|s| {
        s.chains.push_back(refused(1, LinkRefusal::ExceedsCredits));
        s.views.push_back(Ok(Some(full)));
    });
    let decision = check().await.unwrap();
    assert_eq!(
        limited_by_outcome(&decision.outcome),
        Some((30, DecisionSource::Ledger))
    );
    assert_eq!(f.calls(), ["chain", "view"]);
    // 5 s on, listed again: still short, its holds end in 28 s (the old listing said 25).
    f.clock.advance(LISTING_TRUSTED_FOR);
    let still_full = f.view(2, &[28, 28], true);
    f.script(|s| s.views.push_back(Ok(Some(still_full))));
    let decision = check().await.unwrap();
    assert_eq!(
        limited_by_outcome(&decision.outcome),
        Some((28, DecisionSource::Ledger))
    );
    assert_eq!(f.calls(), ["view"], "listed again, no chain");
    let decision = check().await.unwrap();
    assert_eq!(
        limited_by_outcome(&decision.outcome),
        Some((28, DecisionSource::LocalView))
    );
    assert!(f.calls().is_empty(), "the word is new again");
    // 5 s on, the listing fails: refused on the old word, not the failure policy's.
    f.clock.advance(LISTING_TRUSTED_FOR);
    f.script(|s| s.views.push_back(Err(timeout())));
    let decision = check().await.unwrap();
    assert_eq!(
        limited_by_outcome(&decision.outcome),
        Some((23, DecisionSource::LocalView))
    );
    assert_eq!(f.calls(), ["view"]);
    // A second on, another request lists it: one of the holds was voided elsewhere.
    f.clock.advance(Duration::from_secs(1));
    let one_voided = f.view(2, &[22], true);
    let answer = held(&f, &[5, 6]);
    f.script(|s| {
        s.views.push_back(Ok(Some(one_voided)));
        s.chains.push_back(answer);
    });
    let decision = check().await.unwrap();
    assert_eq!(decision.outcome, Outcome::Admitted);
    assert_eq!(f.calls(), ["view", "chain"]);
}

/// Two limits listed by one refusal, both past their trust: the next request lists both again
/// (one listing each); the one still short refuses on its new word, the other's room is stored,
/// so the request after lists only the short one again, and with its room the chain goes.
#[tokio::test]
async fn two_old_words_in_one_request_are_both_listed_again() {
    use crate::limiter::local_view::LISTING_TRUSTED_FOR;
    let f = Fixture::closed();
    let limits = [limit(A, 2, 60, 1), limit(B, 2, 30, 1)];
    let check = || f.limiter.check_all(&limits);
    let (a_full, b_full) = (f.view(2, &[60, 60], true), f.view(2, &[30, 30], true));
    f.script(|s| {
        s.chains.push_back(refused(0, LinkRefusal::ExceedsCredits));
        let b_listed = Ok(Some(b_full.clone()));
        s.views
            .extend([Ok(Some(a_full)), Ok(Some(b_full)), b_listed]);
    });
    let decision = check().await.unwrap();
    assert_eq!(
        limited_by_outcome(&decision.outcome),
        Some((60, DecisionSource::Ledger))
    );
    assert_eq!(f.calls(), ["chain", "view", "free", "view"], "both listed");
    f.clock.advance(LISTING_TRUSTED_FOR);
    let (a_still_full, b_room) = (f.view(2, &[55, 55], true), f.view(2, &[], true));
    f.script(|s| {
        s.views.extend([Ok(Some(a_still_full)), Ok(Some(b_room))]);
    });
    let decision = check().await.unwrap();
    assert_eq!(
        limited_by_outcome(&decision.outcome),
        Some((55, DecisionSource::Ledger))
    );
    assert_eq!(f.calls(), ["view", "view"], "both listed again, no chain");
    f.clock.advance(LISTING_TRUSTED_FOR);
    let a_room = f.view(2, &[], true);
    let answer = held(&f, &[5, 6]);
    f.script(|s| {
        s.views.push_back(Ok(Some(a_room)));
        s.chains.push_back(answer);
    });
    let decision = check().await.unwrap();
    assert_eq!(decision.outcome, Outcome::Admitted);
    assert_eq!(f.calls(), ["view", "chain"], "B's room was kept");
}
