//! The decision: admit or limit one request of a caller, exactly, through the ledger.
//!
//! "Limited" is a value ([`Outcome::Limited`]), not an error. A ledger that fails or is too slow
//! yields [`Outcome::FailedOpen`] or [`Outcome::FailedClosed`] according to the configured
//! [`FailurePolicy`]; a decision never takes longer than the ledger deadline. The limiter counts
//! its own decisions and records them on the request's span, whichever front end asked.

mod account_ids;
pub mod caller;
pub mod counts;
pub mod extra;
pub mod lease;
pub mod local_view;
pub mod metrics;
pub mod moves;
pub mod multi;
pub mod plan;
pub mod settle;
pub mod store;

#[cfg(test)]
mod tests;

use std::num::NonZeroU64;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;

use crate::ledger::model::{self, UserAccount};
use crate::ledger::{AccountView, HoldReply, Ledger, LedgerError, Roundtrip};
use crate::telemetry::span::fields;
use account_ids::AccountIds;
use caller::{CallerKey, KeyError};
pub use lease::RenewalAhead;
pub use local_view::BlockAct;
use local_view::{Check, Generation, Listing, LocalLimit, LocalQuota, LocalView};
use metrics::{DecisionLabel, DecisionMetrics, SourceLabel};
pub use multi::{Limit, LimitStatus, LimitsError, MultiDecision, LIMITS_PER_CHECK_MAX};
use plan::{Plan, PlanBook, PlanId};
use store::{Clock, Store, SystemClock};

/// What to do when the ledger cannot decide in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailurePolicy {
    /// Admit the request (availability over exactness).
    Open,
    /// Refuse it with 503 (exactness over availability).
    Closed,
}

#[derive(Debug, Clone)]
pub struct LimiterSettings {
    /// The deadline for one whole decision, provisioning included.
    pub ledger_timeout: Duration,
    pub failure_policy: FailurePolicy,
    /// How many callers this instance remembers holds for (headers and local 429s).
    pub local_callers_max: usize,
    /// Added to every expiry this instance computes: TigerBeetle releases a hold a little after it
    /// is due (~5 ms typically, at most ~100 ms).
    pub expiry_margin: Duration,
}

/// The quota a response advertises (IETF `RateLimit` / `RateLimit-Policy` fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    pub limit: u64,
    pub window_seconds: u32,
    pub remaining: u64,
    pub reset_seconds: u64,
}

/// Who refused a limited request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecisionSource {
    /// The ledger answered `exceeds_credits`.
    Ledger,
    /// This instance's [`LocalView`] knew the caller to be exhausted: no ledger call. (Once
    /// its word is over 5 s old, one request lists the account again: a refusal then is
    /// the ledger's, [`DecisionSource::Ledger`].)
    LocalView,
}

impl DecisionSource {
    pub fn as_str(self) -> &'static str {
        match self {
            DecisionSource::Ledger => "ledger",
            DecisionSource::LocalView => "local_view",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Admitted,
    Limited {
        /// Whole seconds until enough credit is back for this cost (rounded up, at least 1).
        retry_after_seconds: u64,
        source: DecisionSource,
    },
    /// An operator blocked the caller (admin API); enforced even on routes in shadow mode.
    Blocked {
        /// Whole seconds until the block ends (rounded up, at least 1).
        retry_after_seconds: u64,
        source: DecisionSource,
    },
    FailedOpen(LedgerError),
    FailedClosed(LedgerError),
}

impl Outcome {
    /// Whether the request is refused (limited, blocked, failed closed): every outcome but an
    /// admission and a failure the policy lets through.
    pub fn refuses(&self) -> bool {
        !matches!(self, Outcome::Admitted | Outcome::FailedOpen(_))
    }
}

/// The longest wait between two tries of a give-back ([`Limiter::release_until_expired`]).
pub const RELEASE_RETRY_WAIT_MAX: Duration = Duration::from_secs(10);

/// The hold an admitted request placed: what a refund gives back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HoldReceipt {
    pub transfer_id: u128,
    pub amount: u64,
    /// When this instance counts the hold released (as its local view does).
    pub expires_at: Instant,
}

/// The units of its caller's lease that admitted a request (lease plans): a refund gives them
/// back to the lease while it is open on this instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseReceipt {
    /// The lease's pending transfer.
    pub lease_id: u128,
    pub units: u64,
}

/// What memory alone decided for a request ([`Limiter::from_memory`]).
pub enum FromMemory<'a> {
    /// Refused (429) or blocked (403) by the local view, on a per-request plan.
    Refused(Decision<'a>),
    /// Admitted from the caller's lease, with the renewal ahead of need it made due, if any.
    Leased(Decision<'a>, Option<RenewalAhead>),
}

/// A decision, borrowing its plan from the limiter (no copy on the hot path). A clone has no
/// [`LeaseReceipt`]: units given back from both copies of one request's lease admission made
/// room in the lease for requests it never counted (see the `Clone` impl).
#[derive(Debug, PartialEq, Eq)]
pub struct Decision<'a> {
    pub outcome: Outcome,
    /// The caller's plan, and its place in the limiter's [`PlanBook`].
    pub plan: &'a Plan,
    pub plan_id: PlanId,
    /// The caller's account in the ledger: a non-secret id, safe for traces.
    pub account_id: u128,
    pub quota: Quota,
    /// The hold of an admitted request (none for any other outcome, or when a lease admitted it).
    pub hold: Option<HoldReceipt>,
    /// The lease units that admitted the request, on a lease plan.
    pub leased: Option<LeaseReceipt>,
    /// The route's further limits ([`Limiter::check_with`]), in the route's order.
    pub route_limits: Vec<extra::RouteLimitStatus>,
    /// Which of `route_limits` refused the request (`None`: the plan did, or nobody).
    pub refused_by: Option<usize>,
}

impl Clone for Decision<'_> {
    /// Everything but the lease receipt. A refund takes the receipt out of the decision it is
    /// given, and a lease's book cannot tell one request's units from another's: refunded from
    /// the original and a clone, the lease would admit twice what it counted, and its
    /// settlement hold less than was admitted. (A hold's receipt is kept: a second void of one
    /// transfer is refused by the ledger.)
    fn clone(&self) -> Self {
        Decision {
            outcome: self.outcome.clone(),
            plan: self.plan,
            plan_id: self.plan_id,
            account_id: self.account_id,
            quota: self.quota,
            hold: self.hold,
            leased: None,
            route_limits: self.route_limits.clone(),
            refused_by: self.refused_by,
        }
    }
}

impl Decision<'_> {
    /// Every hold of an admitted request, as (account, hold): its plan's first, then its route
    /// limits'.
    pub fn holds(&self) -> impl Iterator<Item = (u128, HoldReceipt)> + '_ {
        let plan = self.hold.map(|hold| (self.account_id, hold));
        let limits = self.route_limits.iter();
        plan.into_iter()
            .chain(limits.filter_map(|limit| limit.hold.map(|hold| (limit.account_id, hold))))
    }

    /// Its quotas and holds once [`Limiter::recharge`] replaced some of its holds by holds of
    /// `actual` units: `replaced` has one entry per hold, in the order of [`Decision::holds`],
    /// `None` for a hold left as it was, else the new hold's transfer (`None` for an actual cost
    /// of 0: nothing is held any more). The quotas from the admission's alone:
    /// [`Limiter::recharge`] also bounds them by what the view holds free (a recharge the ledger
    /// capped left less). The new receipts are what a later refund voids: the old holds are
    /// voided already, and a refund of them gave nothing back.
    pub(crate) fn recharged(&mut self, actual: u64, replaced: &[Option<Option<u128>>]) {
        let plan = std::iter::once((&mut self.quota, &mut self.hold));
        let limits = self.route_limits.iter_mut();
        let holds = plan.chain(limits.map(|limit| (&mut limit.quota, &mut limit.hold)));
        let mut replaced = replaced.iter().copied();
        for (quota, hold) in holds {
            let Some(old) = *hold else { continue };
            let Some(Some(new)) = replaced.next() else {
                continue;
            };
            // Less than held: the difference given back, as a refund's (whole again, it resets
            // now); more: the difference taken too.
            match old.amount.checked_sub(actual) {
                Some(back) => credit_back(quota, back),
                None => quota.remaining = quota.remaining.saturating_sub(actual - old.amount),
            }
            *hold = new.map(|transfer_id| HoldReceipt {
                transfer_id,
                amount: actual,
                expires_at: old.expires_at,
            });
        }
    }
}

/// `amount` units given back to a quota, which never shows more than its limit; whole again, it
/// resets now (a refunded fresh caller's `t` said a window, and GitHub's reset a window ahead).
fn credit_back(quota: &mut Quota, amount: u64) {
    quota.remaining = quota.remaining.saturating_add(amount).min(quota.limit);
    if quota.remaining == quota.limit {
        quota.reset_seconds = 0;
    }
}

/// The holds of a request that was admitted but not served, to void after its answer
/// ([`Limiter::give_back_later`]): (account, hold), its plan's first.
#[must_use = "holds not voided stay charged until their window ends"]
pub struct HoldsToVoid {
    holds: Vec<(u128, HoldReceipt)>,
}

/// A decision before it is a [`Decision`]: the outcome, the quota, the hold if one admitted it.
type Decided = (Outcome, LocalQuota, Option<HoldReceipt>);

/// What [`Limiter::decide`] reached: the decision, the lease units that admitted it, and the
/// renewal ahead of need that admission made due (lease plans).
type Reached = (Decided, Option<LeaseReceipt>, Option<RenewalAhead>);

/// One request to decide: who pays, on which account, how much.
struct Charge<'a> {
    /// The account the caller's configured plan derives (where a move is recorded).
    home_account_id: u128,
    home_plan_id: PlanId,
    plan_id: PlanId,
    plan: &'a Plan,
    account: UserAccount,
    cost: u64,
}

/// What a hold came to once a missing account was provisioned.
enum Placed {
    Held {
        roundtrip: Roundtrip,
        transfer_id: u128,
    },
    ExceedsCredits,
    Blocked,
}

/// When a decision began (the local view's "now") and by when the ledger must have answered it.
#[derive(Clone, Copy)]
struct Timing {
    started: Instant,
    deadline: Instant,
}

/// How soon a caller refused on a closed account whose read failed is told to come back: the
/// read is tried again then (a moved caller follows the move).
const CLOSED_UNREAD_RETRY: Duration = Duration::from_secs(1);

/// What an instance verified with the ledger of a caller's free credit ([`Limiter::known_free`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KnownFree {
    /// Not remembered, or a guess.
    Unknown,
    /// Listed whole: this much is free now, as far as this instance knows.
    Listed(u64),
    /// Listed lately, but the account holds more than a listing reads: free is unknown.
    ListedIncomplete,
}

/// How long a listing that missed holds (a caller holding more than a listing reads) stands in
/// for another when the ledger refuses the caller again: that refusal is answered at once, as
/// the listing would have had it (`Retry-After` 1: it cannot tell when), for one ledger call
/// rather than up to 18. The ledger still decides every request.
const INCOMPLETE_LISTING_STANDS: Duration = Duration::from_secs(1);

/// Why a decision did not admit: a refusal, or the caller moved to another plan (follow it).
enum NotAdmitted {
    Refused(Outcome, LocalQuota),
    Moved(u64),
}

impl From<(Outcome, LocalQuota)> for NotAdmitted {
    fn from((outcome, local): (Outcome, LocalQuota)) -> Self {
        NotAdmitted::Refused(outcome, local)
    }
}

/// Shared by every worker: one ledger client, one local view.
pub struct Limiter<S: Store = Ledger, C: Clock = SystemClock> {
    store: S,
    clock: C,
    plans: Arc<PlanBook>,
    settings: LimiterSettings,
    local: LocalView,
    moves: moves::Moves,
    decisions: DecisionMetrics,
    leases: lease::LeaseBook,
    account_ids: AccountIds,
    /// Whether decisions are written on the request's span (see [`Limiter::without_span_fields`]).
    span_fields: bool,
    /// Whether a hold that lands after its decision gave up is voided: under the closed policy
    /// (the request was refused), and always for slots ([`Limiter::voiding_late_holds`]).
    void_late_holds: bool,
}

impl<S: Store, C: Clock> std::fmt::Debug for Limiter<S, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiter")
            .field("ledger_id", &self.store.ledger_id())
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

static FAILURE_LOGGED_SECOND: AtomicU64 = AtomicU64::new(0);

fn whole_seconds_up(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// A Retry-After's whole seconds as a refusal says it: rounded up, and a second at least (the
/// reset of the limit that refused is no sooner).
fn retry_after_seconds(retry_after: Duration) -> u64 {
    whole_seconds_up(retry_after).max(1)
}

impl Limiter {
    /// Install the `metrics` recorder first: the decision counters bind to it here.
    pub fn new(ledger: Ledger, plans: Arc<PlanBook>, settings: LimiterSettings) -> Self {
        Limiter::with_seams(ledger, SystemClock, plans, settings)
    }
}

impl<S: Store, C: Clock> Limiter<S, C> {
    /// A limiter over any [`Store`] and [`Clock`] (tests script both).
    pub fn with_seams(store: S, clock: C, plans: Arc<PlanBook>, settings: LimiterSettings) -> Self {
        let local = LocalView::new(settings.local_callers_max, settings.expiry_margin)
            .with_probe_pending(settings.ledger_timeout);
        let decisions = DecisionMetrics::register(&plans, settings.ledger_timeout);
        let leases = lease::LeaseBook::new(&plans);
        let account_ids = AccountIds::new(plans.plans().len());
        // Under the closed policy a late hold belongs to a refused request (read before `settings`
        // moves in).
        let void_late_holds = settings.failure_policy == FailurePolicy::Closed;
        Limiter {
            store,
            clock,
            plans,
            settings,
            local,
            moves: moves::Moves::default(),
            decisions,
            leases,
            account_ids,
            span_fields: true,
            void_late_holds,
        }
    }

    /// A limiter whose holds that land after their decision gave up are always voided, whatever
    /// the failure policy: a concurrency slot is no rate unit a request may have used; kept, it
    /// would be taken for its whole timeout by a request long finished.
    pub fn voiding_late_holds(mut self) -> Self {
        self.void_late_holds = true;
        self
    }

    /// A limiter whose decisions are counted but not written on the request's span: a second
    /// limiter deciding on the same request (a concurrency slot) must not overwrite the caller's
    /// account, plan and decision there with its own.
    pub fn without_span_fields(mut self) -> Self {
        self.span_fields = false;
        self
    }

    pub fn plans(&self) -> &PlanBook {
        &self.plans
    }

    pub fn ledger(&self) -> &S {
        &self.store
    }

    /// Moves what each thread counted (decisions, lease admissions) to the `metrics` counters:
    /// call it before rendering them. Without it, each thread's counts lag by less than
    /// [`counts::SPILL_COUNT`] per counter.
    ///
    /// The store's own gauges too (the ledger's calls in flight and batches sent): a library
    /// user calls this alone before rendering, as the README says, and those stayed at 0.
    pub fn drain_counts(&self) {
        self.decisions.drain();
        self.leases.drain_counts();
        self.store.publish_at_scrape();
    }

    pub fn settings(&self) -> &LimiterSettings {
        &self.settings
    }

    /// The deadline of a decision (or a step of one) that starts now: `ledger.timeout_ms` from
    /// now, by this limiter's clock.
    pub fn deadline(&self) -> Instant {
        self.clock.now() + self.settings.ledger_timeout
    }

    /// What this instance verified with the ledger of the credit `account_id` has free.
    pub fn known_free(&self, account_id: u128) -> KnownFree {
        match self.local.verified_free(account_id, self.clock.now()) {
            None => KnownFree::Unknown,
            Some((_, true)) => KnownFree::ListedIncomplete,
            Some((free, false)) => KnownFree::Listed(free),
        }
    }

    /// Whole seconds until `cost` fits on `account` were `amount` more held now for its window
    /// (the Envoy front end's over-charge, at the most it can hold), as this instance verified
    /// the account; `None` if it cannot tell (it does not know the caller, verified). Nothing
    /// is recorded: what the ledger held may be less.
    pub fn seconds_until_fits_after_hold(
        &self,
        account: &UserAccount,
        amount: u64,
        cost: u64,
    ) -> Option<u64> {
        let window = Duration::from_secs(account.window_seconds.get().into());
        let now = self.clock.now();
        let fits = self
            .local
            .fits_after_hold(account.id, cost, (amount, window), now)?;
        Some(whole_seconds_up(fits))
    }

    /// Whole seconds until a hold placed now for `window_seconds` has expired (its timeout,
    /// then `ledger.expiry_margin_ms`): a `Retry-After` that is never too early for it.
    pub fn seconds_until_expired(&self, window_seconds: u32) -> u64 {
        let window = Duration::from_secs(window_seconds.into());
        whole_seconds_up(window + self.settings.expiry_margin)
    }

    /// Whether the ledger answers within `timeout` (readiness).
    pub async fn ready(&self, timeout: Duration) -> Result<(), LedgerError> {
        self.store.ping(self.clock.now() + timeout).await
    }

    /// How many callers this instance's local view remembers (at most `local_callers_max`,
    /// rounded up to a multiple of the view's 64 shards).
    pub fn local_callers(&self) -> usize {
        self.local.callers()
    }

    /// Forgets what this instance knew of an account (an operator just changed its credit or
    /// block): its next request asks the ledger.
    pub fn forget_local(&self, account_id: u128) {
        self.forget_acted_on(account_id, BlockAct::Unchanged);
    }

    /// [`Limiter::forget_local`] after an operator's act here that did `act` to the caller's
    /// block: the failure policy keeps refusing a caller blocked (a block just made included),
    /// and stops once unblocked.
    pub fn forget_acted_on(&self, account_id: u128, act: BlockAct) {
        let now = self.clock.now();
        self.local.forget_acted_on(account_id, act, now);
    }

    /// Forgets everything this instance knew of callers (an operator acted somewhere), but for
    /// the blocks it read, which answer for the failure policy alone.
    pub fn forget_all_local(&self) {
        self.local.clear(self.clock.now());
    }

    /// The ledger account `key` is charged to, if it has a plan, as far as this instance knows
    /// (the moves it has followed). An operator's lookup wants [`Limiter::current_account`].
    pub fn account_of(&self, key: &CallerKey) -> Option<u128> {
        self.charge(key, NonZeroU64::MIN)
            .map(|charge| charge.account.id)
    }

    /// The account `key` is charged to now, and its plan, following in the ledger every move an
    /// operator made (here, on another instance or from the command line), which this instance
    /// then remembers. `None` when the key has no plan. For operators: on a moved caller that
    /// this instance had not followed, [`Limiter::account_of`] named the closed old account,
    /// and a block of it answered "blocked already" while the caller went on being admitted.
    pub async fn current_account(
        &self,
        key: &CallerKey,
        deadline: Instant,
    ) -> Result<Option<(u128, &Plan)>, LedgerError> {
        for _ in 0..=moves::moves_followed_max(&self.plans) {
            let Some(charge) = self.charge(key, NonZeroU64::MIN) else {
                return Ok(None);
            };
            let view = self.view(&charge, deadline).await?;
            let moved = moved_to(&Ok(view)).and_then(|tag| moves::plan_of_tag(&self.plans, tag));
            match moved {
                Some(plan) if plan != charge.plan_id => {
                    self.moves
                        .learn(charge.home_account_id, plan, charge.home_plan_id);
                }
                _ => return Ok(Some((charge.account.id, charge.plan))),
            }
        }
        Err(LedgerError::Unexpected {
            operation: crate::ledger::metrics::Operation::GetAccountTransfers,
            message: "a caller moved more times than a lookup follows".to_owned(),
        })
    }

    /// Gives an admitted request's credit back now (the handler failed: callers are not charged
    /// for our errors). `Ok(false)` when there was nothing to give back: no hold, or it had expired,
    /// or the lease that admitted it was settled already (its settlement holds the units).
    /// Taking the lease receipt out makes a second refund of the same decision give nothing.
    pub async fn refund(&self, decision: &mut Decision<'_>) -> Result<bool, LedgerError> {
        let given = self.give_back(decision).await?;
        if given {
            self.decisions.record_refund(decision.plan_id);
        }
        Ok(given)
    }

    /// Caps a decision's quotas at what this instance's view holds free now, with the view's
    /// `t` where it caps: what the caller's other requests took while this one ran counts
    /// (a refund's fields said the quota was whole, `r=q;t=0`, while the others held all but
    /// the unit it gave back).
    pub(super) fn within_view(&self, decision: &mut Decision<'_>) {
        let now = self.clock.now();
        let within_view = |account_id: u128, quota: &mut Quota| {
            let known = self.local.quota(account_id, quota.limit, now);
            if known.remaining < quota.remaining {
                quota.remaining = known.remaining;
                quota.reset_seconds = whole_seconds_up(known.reset_after);
            }
        };
        within_view(decision.account_id, &mut decision.quota);
        for limit in &mut decision.route_limits {
            within_view(limit.account_id, &mut limit.quota);
        }
    }

    /// [`Limiter::refund`] without counting it as one. What is given back is in the decision's
    /// quotas too, so the response's rate-limit fields say what the caller has left after it.
    async fn give_back(&self, decision: &mut Decision<'_>) -> Result<bool, LedgerError> {
        if let Some(given) = self.give_back_leased(decision) {
            return Ok(given);
        }
        let Some(hold) = decision.hold else {
            return Ok(false);
        };
        // Every hold at once, by one deadline: in turn, each void had a deadline of its own (a
        // slow ledger made a refund wait one per limit), and one that failed kept the rest,
        // the plan's included, charged.
        let deadline = self.deadline();
        let routes = decision.route_limits.iter().map(|limit| async move {
            let hold = limit.hold?;
            Some(self.release_by(limit.account_id, hold, deadline).await)
        });
        let plan = self.release_by(decision.account_id, hold, deadline);
        let (routes, plan) = futures_util::future::join(join_all(routes), plan).await;
        // A route limit's hold given back is a refund too: its window may outlast the plan's,
        // whose hold had expired (a day's limit, a slow handler on a plan of a second).
        let mut routes_given = false;
        for (limit, released) in decision.route_limits.iter_mut().zip(routes) {
            match (limit.hold, released) {
                (Some(hold), Some(Ok(true))) => {
                    credit_back(&mut limit.quota, hold.amount);
                    routes_given = true;
                }
                (_, Some(Err(error))) => {
                    tracing::debug!(%error, "could not give a route limit's hold back; it expires with its window");
                }
                _ => {}
            }
        }
        // A route limit's hold given back is given back whatever became of the plan's.
        let given = match plan {
            Ok(given) => given,
            Err(error) if routes_given => {
                tracing::debug!(%error, "could not give the plan's hold back; it expires with its window");
                false
            }
            Err(error) => return Err(error),
        };
        if given {
            credit_back(&mut decision.quota, hold.amount);
        }
        self.within_view(decision);
        Ok(given || routes_given)
    }

    /// The lease units that admitted `decision` back to its caller's lease, in memory, and in
    /// its quota: `None` when no lease admitted it, else whether they were given back (the lease
    /// may have been settled meanwhile). Taking the receipt out makes a second give-back nothing.
    fn give_back_leased(&self, decision: &mut Decision<'_>) -> Option<bool> {
        let leased = decision.leased.take()?;
        let given = self.leases.give_back(decision.account_id, leased);
        if given {
            credit_back(&mut decision.quota, leased.units);
        }
        Some(given)
    }

    /// A refund not counted as one ([`Limiter::refund`]), for an answer that does not wait for
    /// the ledger: lease units come back now, and the holds are handed out, to be voided after
    /// the answer by [`Limiter::void_holds`]. The decision's quotas count them as given back
    /// already. Why: a request refused a concurrency slot has spent its one deadline on its two
    /// decisions, and a give-back within it would, on a slow ledger, be cut short and keep the
    /// caller charged.
    pub fn give_back_later(&self, decision: &mut Decision<'_>) -> Option<HoldsToVoid> {
        if self.give_back_leased(decision).is_some() {
            return None;
        }
        // Taken out of the decision: a second give-back or a refund of it finds nothing.
        let holds: Vec<(u128, HoldReceipt)> = decision.holds().collect();
        // Capped first, while the view still counts these holds as the quotas do: what the
        // caller's other requests took while this one waited counts (its 429 said `r=q;t=0`).
        self.within_view(decision);
        if let Some(hold) = decision.hold.take() {
            credit_back(&mut decision.quota, hold.amount);
        }
        for limit in &mut decision.route_limits {
            if let Some(hold) = limit.hold.take() {
                credit_back(&mut limit.quota, hold.amount);
            }
        }
        (!holds.is_empty()).then_some(HoldsToVoid { holds })
    }

    /// Voids the holds [`Limiter::give_back_later`] handed out, together, within one
    /// `ledger.timeout_ms` from now. One that fails expires with its window. (Not sent again
    /// as a slot's is: a rate hold may last a day, and its retries would take places from live
    /// decisions all that time while the ledger struggles.)
    pub async fn void_holds(&self, holds: HoldsToVoid) {
        let deadline = self.deadline();
        let voids = holds.holds.into_iter().map(|(account_id, hold)| async move {
            if let Err(error) = self.release_by(account_id, hold, deadline).await {
                tracing::debug!(%error, "could not give a hold back; it expires with its window");
            }
        });
        join_all(voids).await;
    }

    /// [`Limiter::release`], sent again after a failure that may pass (the ledger slow or
    /// failing over, the in-flight bound full) until the hold would have expired anyway, for a
    /// concurrency slot (whose hold lasts `routes.concurrency_timeout_seconds`): one given back
    /// once and lost kept its caller refused until then (a minute by default), nothing in
    /// flight. Each try waits a ledger timeout,
    /// doubled per try, at most [`RELEASE_RETRY_WAIT_MAX`]. A void that landed unseen makes its
    /// retry answer "already voided": nothing is given back twice.
    pub async fn release_until_expired(&self, account_id: u128, hold: HoldReceipt) {
        let mut wait = self.settings.ledger_timeout;
        loop {
            let error = match self.release(account_id, hold).await {
                Ok(_) => return,
                Err(error) => error,
            };
            let expired_by_then = self.clock.now() + wait >= hold.expires_at;
            if matches!(error, LedgerError::Unexpected { .. }) || expired_by_then {
                tracing::debug!(%error, "could not give a hold back; it expires with its window");
                return;
            }
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(RELEASE_RETRY_WAIT_MAX);
        }
    }

    /// Voids one hold of `account_id` (its credit comes back now, here and in the ledger):
    /// a refund, or a concurrency slot whose request is done. `Ok(false)` if it had expired.
    pub async fn release(&self, account_id: u128, hold: HoldReceipt) -> Result<bool, LedgerError> {
        let deadline = self.deadline();
        self.release_by(account_id, hold, deadline).await
    }

    /// [`Limiter::release`] by `deadline` (a decision's, for a void that is part of it).
    pub async fn release_by(
        &self,
        account_id: u128,
        hold: HoldReceipt,
        deadline: Instant,
    ) -> Result<bool, LedgerError> {
        let dropped = ForgetIfDropped::new(&self.local, [account_id]);
        let voided = self.store.void(hold.transfer_id, deadline).await;
        dropped.disarm();
        match voided {
            Ok(true) => self.local.release(account_id, hold.amount, hold.expires_at),
            Ok(false) => {}
            // Landed or not, unknown: the view forgets the caller rather than count the hold on
            // (a void that landed would leave 429s from memory for what the ledger admits).
            Err(_) => self.local.forget(account_id),
        }
        voided
    }
}

/// Forgets callers in the local view when dropped, unless disarmed first. Why: a give-back, a
/// recharge or a lease's settlement runs at the ledger in a task of its own, so it lands even
/// when its request is dropped at the await (its client gone); the view, left counting the old
/// holds, would then refuse from memory what the ledger admits, for up to a window.
struct ForgetIfDropped<'a, A: AsRef<[u128]>> {
    local: &'a LocalView,
    account_ids: A,
    armed: bool,
}

impl<'a, A: AsRef<[u128]>> ForgetIfDropped<'a, A> {
    fn new(local: &'a LocalView, account_ids: A) -> Self {
        ForgetIfDropped {
            local,
            account_ids,
            armed: true,
        }
    }

    /// Done: the caller updates the view itself.
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl<A: AsRef<[u128]>> Drop for ForgetIfDropped<'_, A> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        for &account_id in self.account_ids.as_ref() {
            self.local.forget(account_id);
        }
    }
}

impl<S: Store, C: Clock> Limiter<S, C> {
    /// Counts a refusal that a route in shadow mode lets through, and marks the request's span.
    pub fn pass_in_shadow(&self, decision: &Decision<'_>) {
        let label = DecisionLabel::of(&decision.outcome);
        self.decisions.record_shadow(decision.plan_id, label);
        tracing::Span::current().record(fields::SHADOW, true);
    }

    /// Counts a request refused before any decision because its key was malformed or missing.
    pub fn reject_key(&self) {
        self.decisions
            .record(DecisionLabel::RejectedKey, None, SourceLabel::None);
        let span = tracing::Span::current();
        span.record(fields::DECISION, DecisionLabel::RejectedKey.as_str());
    }

    /// Decides one request of `cost` units for `key`: `Err` (and no ledger call) when the key has
    /// no plan, a [`Decision`] otherwise, counted and recorded on the current span. A renewal
    /// ahead of need that the admission made due runs before it returns, within the same
    /// deadline ([`Limiter::check_with`] leaves it to its caller instead).
    pub async fn check(&self, key: &CallerKey, cost: NonZeroU64) -> Result<Decision<'_>, KeyError> {
        let deadline = self.deadline();
        self.check_by(key, cost, deadline).await
    }

    /// [`Limiter::check`] with every ledger call answered by `deadline`: a step of a request
    /// whose other steps share it (an HTTP request's concurrency slot after its rate decision),
    /// so that the request's answer comes within one deadline, not one per step.
    pub async fn check_by(
        &self,
        key: &CallerKey,
        cost: NonZeroU64,
        deadline: Instant,
    ) -> Result<Decision<'_>, KeyError> {
        let (decision, renewal) = self.check_leaving_renewal(key, cost, deadline).await?;
        if let Some(renewal) = renewal {
            self.renew_lease_ahead_by(renewal, deadline).await;
        }
        Ok(decision)
    }

    /// [`Limiter::check_by`], with the renewal ahead of need (if any) for the caller to run.
    async fn check_leaving_renewal(
        &self,
        key: &CallerKey,
        cost: NonZeroU64,
        deadline: Instant,
    ) -> Result<(Decision<'_>, Option<RenewalAhead>), KeyError> {
        let Some(mut charge) = self.charge(key, cost) else {
            self.reject_key();
            return Err(KeyError::Unknown);
        };
        let mut followed = 0;
        let ((outcome, local, hold), leased, renewal) = loop {
            match self.decide(&charge, deadline).await {
                Ok(decided) => break decided,
                Err(tag) => match moves::plan_of_tag(&self.plans, tag) {
                    Some(plan) if followed < moves::moves_followed_max(&self.plans) => {
                        followed += 1;
                        self.moves
                            .learn(charge.home_account_id, plan, charge.home_plan_id);
                        charge = self.charge(key, cost).expect("it had a plan");
                    }
                    // Moved to a plan this configuration lacks (or moving in circles): refuse
                    // as blocked, and let the operator see it.
                    _ => {
                        tracing::warn!(account_id = %format_args!("{:032x}", charge.account.id), "caller moved to a plan this configuration does not have");
                        let window =
                            Duration::from_secs(charge.account.window_seconds.get().into());
                        let mut quota = self.local.quota(charge.account.id, 0, self.clock.now());
                        // `t` as long as the Retry-After, as on any block.
                        quota.reset_after = quota.reset_after.max(window);
                        let outcome = refused(window, DecisionSource::Ledger, true);
                        break ((outcome, quota, None), None, None);
                    }
                },
            }
        };
        let decision = decision(&charge, outcome, local, hold, leased);
        self.record(&decision, key, cost);
        Ok((decision, renewal))
    }

    /// The decision [`Limiter::check`] reaches without waiting, when memory alone can make it
    /// (counted and recorded the same way):
    /// - on a per-request plan, a refusal by the local view;
    /// - on a lease plan, when `may_lease`, an admission from the caller's lease, with the
    ///   renewal ahead of need it made due, if any, for the caller to run
    ///   ([`Limiter::renew_lease_ahead`]) after answering.
    ///
    /// `None`, with nothing spent, when anything else must happen: the ledger, a lease that
    /// cannot admit the request, or [`Limiter::check`] itself for a key without a plan. Why:
    /// these are the abusive and the hot caller's paths, and the HTTP middleware answers them
    /// without making the request's future (a kilobyte, allocated and moved on each request) and
    /// without waiting for the ledger.
    pub fn from_memory(
        &self,
        key: &CallerKey,
        cost: NonZeroU64,
        may_lease: bool,
    ) -> Option<FromMemory<'_>> {
        let charge = self.charge(key, cost)?;
        let decided = match charge.plan.lease() {
            None => {
                let (outcome, quota) = self.refused_locally(&charge, self.clock.now())?;
                FromMemory::Refused(decision(&charge, outcome, quota, None, None))
            }
            Some(terms) if may_lease => {
                let ((outcome, local, hold), leased, renewal) =
                    self.admit_from_lease_now(&charge, terms)?;
                let decision = decision(&charge, outcome, local, hold, Some(leased));
                FromMemory::Leased(decision, renewal)
            }
            Some(_) => return None,
        };
        let (FromMemory::Refused(decision) | FromMemory::Leased(decision, _)) = &decided;
        self.record(decision, key, cost);
        Some(decided)
    }

    /// The account `key` has on `plan` (the plan is part of its identity).
    fn account_on(&self, key: &CallerKey, plan: &Plan) -> u128 {
        let key = key.expose_secret().as_bytes();
        model::user_account_id(self.store.ledger_id(), plan.name(), plan.capacity(), key)
    }

    /// [`Limiter::account_on`], remembered per key and plan ([`AccountIds`]).
    fn account_id(&self, key: &CallerKey, plan_id: PlanId, plan: &Plan) -> u128 {
        let bytes = key.expose_secret().as_bytes();
        self.account_ids
            .get_or_derive(plan_id, bytes, || self.account_on(key, plan))
    }

    fn charge(&self, key: &CallerKey, cost: NonZeroU64) -> Option<Charge<'_>> {
        let home_plan_id = self.plans.plan_for(key)?;
        let home_plan = self.plans.get(home_plan_id)?;
        let home_account_id = self.account_id(key, home_plan_id, home_plan);
        let plan_id = self.moves.get(home_account_id).unwrap_or(home_plan_id);
        let plan = self.plans.get(plan_id)?;
        let id = if plan_id == home_plan_id {
            home_account_id
        } else {
            self.account_id(key, plan_id, plan)
        };
        Some(Charge {
            home_account_id,
            home_plan_id,
            plan_id,
            account: UserAccount {
                id,
                capacity: plan.capacity(),
                window_seconds: plan.window_seconds(),
            },
            plan,
            cost: cost.get(),
        })
    }

    /// From the caller's lease on lease plans (`lease.rs`), else per request. `Err` with the new
    /// plan's tag when the caller moved to another plan.
    async fn decide(&self, charge: &Charge<'_>, deadline: Instant) -> Result<Reached, u64> {
        let at = Timing {
            started: self.clock.now(),
            deadline,
        };
        if let Some(terms) = charge.plan.lease() {
            return self.decide_leased(charge, terms, at).await;
        }
        let decided = self.decide_per_request(charge, at).await?;
        Ok((decided, None, None))
    }

    /// Local refusal, else one hold; on `exceeds_credits`, a second look at the account decides
    /// between one more hold and a 429.
    async fn decide_per_request(
        &self,
        charge: &Charge<'_>,
        at: Timing,
    ) -> Result<(Outcome, LocalQuota, Option<HoldReceipt>), u64> {
        match self.try_decide(charge, at).await {
            Ok(admitted) => Ok(admitted),
            Err(NotAdmitted::Refused(outcome, local)) => Ok((outcome, local, None)),
            Err(NotAdmitted::Moved(tag)) => Err(tag),
        }
    }

    /// The local view's refusal of `charge` at `now`, if it refuses: the one answer both
    /// [`Limiter::check`] (before any ledger call) and [`Limiter::from_memory`] give from memory.
    fn refused_locally(&self, charge: &Charge<'_>, now: Instant) -> Option<(Outcome, LocalQuota)> {
        let id = charge.account.id;
        match self.local.check_trusted(id, charge.cost, now, false) {
            Check::Refuse(limit) => Some(refused_from_memory(limit)),
            // A probe is the decision's (off this path, which never waits for the ledger).
            Check::Ask | Check::Probe(_) => None,
        }
    }

    /// `Ok` when admitted (with the hold's receipt), `Err` with any other outcome.
    async fn try_decide(
        &self,
        charge: &Charge<'_>,
        at: Timing,
    ) -> Result<(Outcome, LocalQuota, Option<HoldReceipt>), NotAdmitted> {
        let id = charge.account.id;
        let probe = match self.local.check_trusted(id, charge.cost, at.started, true) {
            Check::Refuse(limit) => {
                let (outcome, quota) = refused_from_memory(limit);
                return Err(NotAdmitted::Refused(outcome, quota));
            }
            Check::Probe(limit) => Some(limit),
            Check::Ask => None,
        };
        // Boxed: the ledger's futures are kilobytes, and every enclosing future (up to the
        // middleware's) would otherwise be that large and copied on each request, refusals from
        // memory included. One allocation on a path that waits for the ledger anyway.
        Box::pin(async move {
            if let Some(stale) = probe {
                if let Some(refusal) = self.listed_again(charge, stale, at.deadline).await {
                    return Err(refusal.into());
                }
            }
            self.decide_on_ledger(charge, at.deadline).await
        })
        .await
    }

    /// A probe of a caller the view has refused on a word of the ledger's over
    /// [`local_view::LISTING_TRUSTED_FOR`] old: its account listed again (reads, no transfer),
    /// in place of the old listing, which counts as held what another instance may have voided
    /// since (a refund, a late hold's void, a slot's give-back). Still short: refused, on the
    /// ledger's word just read (its holds, so its `Retry-After`). With room, or closed, or
    /// gone: `None`, and the ledger decides. The listing failed: refused from memory as before
    /// (`stale`; a later request probes again).
    async fn listed_again(
        &self,
        charge: &Charge<'_>,
        stale: LocalLimit,
        deadline: Instant,
    ) -> Option<(Outcome, LocalQuota)> {
        let read = self.local.generation(charge.account.id);
        let view = self.refused_view(charge, deadline).await;
        match &view {
            Err(_) => return Some(refused_from_memory(stale)),
            Ok(Some(listed)) if listed.blocked.is_none() => {}
            // Closed or gone: what the ledger says of a hold, it says best.
            Ok(_) => return None,
        }
        let (retry_after, quota) = self.retry_after(charge, view, read);
        let outcome = refused(retry_after, DecisionSource::Ledger, false);
        quota.map(|quota| (outcome, quota))
    }

    /// [`Limiter::try_decide`] past the local view: a hold, and the ledger's word on a refusal.
    async fn decide_on_ledger(
        &self,
        charge: &Charge<'_>,
        deadline: Instant,
    ) -> Result<(Outcome, LocalQuota, Option<HoldReceipt>), NotAdmitted> {
        // Before any listing of the account is asked for (`LocalView::replace` says why).
        let read = self.local.generation(charge.account.id);
        let mut provisioned = false;
        match self.place(charge, deadline, &mut provisioned).await? {
            Placed::Held {
                roundtrip,
                transfer_id,
            } => return Ok(self.admitted(charge, roundtrip, transfer_id)),
            Placed::ExceedsCredits => {
                if let Some(refusal) = self.refused_as_listed(charge) {
                    return Err(refusal.into());
                }
            }
            Placed::Blocked => return Err(self.refused_closed(charge, deadline, read).await),
        }
        let view = self.refused_view(charge, deadline).await;
        match second_chance(&view, charge.cost) {
            None => return Err(self.limited_by_ledger(charge, view, read).into()),
            Some(SecondChance::FinishProvisioning) => {
                if let Err(error) = self.store.provision(&charge.account, deadline).await {
                    return Err(self.fail(error, charge).into());
                }
            }
            Some(SecondChance::CreditIsBack) => {}
        }
        match self.place(charge, deadline, &mut provisioned).await? {
            Placed::Held {
                roundtrip,
                transfer_id,
            } => Ok(self.admitted(charge, roundtrip, transfer_id)),
            Placed::Blocked => Err(self.refused_closed(charge, deadline, read).await),
            Placed::ExceedsCredits => {
                let view = self.refused_view(charge, deadline).await;
                Err(self.limited_by_ledger(charge, view, read).into())
            }
        }
    }

    /// The ledger refused a caller whose account this instance listed in the last
    /// [`INCOMPLETE_LISTING_STANDS`] and found holding more than a listing reads: the refusal
    /// as that listing had it, without listing the account again.
    fn refused_as_listed(&self, charge: &Charge<'_>) -> Option<(Outcome, LocalQuota)> {
        let listed = self.listed_lately_incomplete(charge.account.id)?;
        // `t` never before `Retry-After`: the listing's holds may all be gone by now.
        let quota = LocalQuota {
            remaining: 0,
            reset_after: listed.reset_after.max(INCOMPLETE_LISTING_STANDS),
        };
        let outcome = refused(INCOMPLETE_LISTING_STANDS, DecisionSource::Ledger, false);
        Some((outcome, quota))
    }

    /// The quota of `account_id` if this instance listed it in the last
    /// [`INCOMPLETE_LISTING_STANDS`] and that listing missed holds.
    fn listed_lately_incomplete(&self, account_id: u128) -> Option<LocalQuota> {
        let now = self.clock.now();
        let since = now.checked_sub(INCOMPLETE_LISTING_STANDS)?;
        self.local.listed_incomplete_since(account_id, since, now)
    }

    /// The ledger refused the hold on a closed account (a block, or a move away): read which.
    /// If that read fails, the request is refused (the ledger said no, so never admitted,
    /// whatever the policy; a 503 would be admitted by an Envoy that fails open), but told to
    /// come back in [`CLOSED_UNREAD_RETRY`], not a window: a moved caller follows the move at
    /// its next request. The block this instance knows, if any, answers instead.
    async fn refused_closed(
        &self,
        charge: &Charge<'_>,
        deadline: Instant,
        read: Generation,
    ) -> NotAdmitted {
        let refused = self.refused_if_closed(charge, (deadline, read), true).await;
        refused.expect("refused whatever the account reads")
    }

    /// [`Limiter::refused_closed`], or with `just_refused` false (the ledger refused a lease on
    /// the closed account a while ago, `lease.rs`), `None` when the account now reads open: an
    /// unblock since, decided per request.
    async fn refused_if_closed(
        &self,
        charge: &Charge<'_>,
        (deadline, read): (Instant, Generation),
        just_refused: bool,
    ) -> Option<NotAdmitted> {
        let view = self.view(charge, deadline).await;
        if let Some(tag) = moved_to(&view) {
            return Some(NotAdmitted::Moved(tag));
        }
        let error = match view {
            Err(error) => error,
            Ok(open) if !just_refused && open.as_ref().is_none_or(|v| v.blocked.is_none()) => {
                // Unblocked since: newer than the block the renewal read into the view.
                self.remember_open(charge, open.as_ref(), read);
                return None;
            }
            view => return Some(self.limited_by_ledger(charge, view, read).into()),
        };
        tracing::debug!(%error, "a closed account could not be read; refused for a second");
        let now = self.clock.now();
        if let Some(blocked) = self.known_block_refusal(charge.account.id, now) {
            return Some(blocked.into());
        }
        let capacity = charge.account.capacity.get();
        let known = self.local.quota(charge.account.id, capacity, now);
        let local = LocalQuota {
            remaining: 0,
            reset_after: known.reset_after.max(CLOSED_UNREAD_RETRY),
        };
        let outcome = refused(CLOSED_UNREAD_RETRY, DecisionSource::Ledger, false);
        Some((outcome, local).into())
    }

    /// Stores a listing that reads `charge`'s account open (`None`: not found) in the local view,
    /// in place of a block read before.
    fn remember_open(&self, charge: &Charge<'_>, open: Option<&AccountView>, read: Generation) {
        let Some(view) = open else { return };
        let hold_max = self.hold_max();
        let (now, wall) = (self.clock.now(), self.clock.wall());
        let listing = Listing { view, read };
        self.local
            .replace(charge.account.id, listing, 0, hold_max, now, wall);
    }

    /// The longest any hold of these plans lasts (a lease's window + L): how far back a listing
    /// reads. A window alone missed a lease an instance left to expire for its last L − 5 s,
    /// and a refusal then read room the ledger did not have (`Retry-After: 1`, nothing kept).
    fn hold_max(&self) -> Duration {
        Duration::from_secs(self.plans.hold_seconds_max().get().into())
    }

    /// One hold; a caller the ledger does not know yet is provisioned (at most once per decision)
    /// and held again. A ledger error comes back as the failure policy's outcome.
    async fn place(
        &self,
        charge: &Charge<'_>,
        deadline: Instant,
        provisioned: &mut bool,
    ) -> Result<Placed, (Outcome, LocalQuota)> {
        self.place_or_error(charge, deadline, provisioned)
            .await
            .map_err(|error| self.fail(error, charge))
    }

    async fn place_or_error(
        &self,
        charge: &Charge<'_>,
        deadline: Instant,
        provisioned: &mut bool,
    ) -> Result<Placed, LedgerError> {
        loop {
            let reply = self
                .store
                .hold(
                    charge.account.id,
                    charge.cost,
                    charge.account.window_seconds.get(),
                    deadline,
                    self.void_late_holds,
                )
                .await?;
            match reply {
                HoldReply::Held {
                    roundtrip,
                    transfer_id,
                } => {
                    return Ok(Placed::Held {
                        roundtrip,
                        transfer_id,
                    })
                }
                HoldReply::ExceedsCredits => return Ok(Placed::ExceedsCredits),
                HoldReply::Blocked => return Ok(Placed::Blocked),
                HoldReply::AccountNotFound if !*provisioned => {
                    self.store.provision(&charge.account, deadline).await?;
                    tracing::debug!(account_id = %format_args!("{:032x}", charge.account.id), "provisioned");
                    *provisioned = true;
                }
                HoldReply::AccountNotFound => {
                    let error = LedgerError::Unexpected {
                        operation: crate::ledger::metrics::Operation::CreateTransfers,
                        message: "account not found right after provisioning".to_owned(),
                    };
                    self.store.record_error(&error);
                    return Err(error);
                }
            }
        }
    }

    async fn view(
        &self,
        charge: &Charge<'_>,
        deadline: Instant,
    ) -> Result<Option<AccountView>, LedgerError> {
        let hold_seconds_max = self.plans.hold_seconds_max().get();
        self.store
            .account_view(charge.account.id, hold_seconds_max, deadline)
            .await
    }

    /// [`Limiter::refusal_read`] of the charge's account.
    async fn refused_view(
        &self,
        charge: &Charge<'_>,
        deadline: Instant,
    ) -> Result<Option<AccountView>, LedgerError> {
        let hold_seconds_max = self.plans.hold_seconds_max().get();
        let account = (charge.account.id, true);
        (self.refusal_read(account, hold_seconds_max, deadline)).await
    }

    /// What a refusal for want of credit reads of `account_id`: its holds listed (a lookup and
    /// up to [`crate::ledger::TRANSFERS_PAGES_MAX`] pages) when this instance's view can keep the
    /// listing; else one lookup, as a listing of no holds that is incomplete, so the refusal says
    /// the shortest `Retry-After`. Why: a listing the view cannot keep (it is full, or off, as a
    /// concurrency limit's) was paid again on every refused request, up to 18 ledger calls each.
    pub(crate) async fn refusal_read(
        &self,
        (account_id, local_view): (u128, bool),
        window_seconds_max: u32,
        deadline: Instant,
    ) -> Result<Option<AccountView>, LedgerError> {
        if local_view && self.local.can_keep(account_id, self.clock.now()) {
            return (self.store)
                .account_view(account_id, window_seconds_max, deadline)
                .await;
        }
        let free = (self.store)
            .account_free(account_id, window_seconds_max, deadline)
            .await?;
        match free {
            // Closed meanwhile: what closed it is read in full (a block's end, or a move).
            Some(free) if free.closed => {
                (self.store)
                    .account_view(account_id, window_seconds_max, deadline)
                    .await
            }
            free => Ok(free.map(|free| AccountView {
                credit: free.credit,
                granted: free.granted,
                available: free.available,
                holds: Vec::new(),
                complete: false,
                blocked: None,
            })),
        }
    }

    fn admitted(
        &self,
        charge: &Charge<'_>,
        roundtrip: Roundtrip,
        transfer_id: u128,
    ) -> (Outcome, LocalQuota, Option<HoldReceipt>) {
        let window = Duration::from_secs(charge.account.window_seconds.get().into());
        let local = self.local.record_hold(
            charge.account.id,
            charge.account.capacity.get(),
            charge.cost,
            roundtrip,
            window,
            self.clock.now(),
        );
        let receipt = HoldReceipt {
            transfer_id,
            amount: charge.cost,
            expires_at: roundtrip.answered_at + window + self.settings.expiry_margin,
        };
        (Outcome::Admitted, local, Some(receipt))
    }

    /// A refusal the ledger decided: out of credit, or blocked (as the account says; a block
    /// that ended between the two calls is answered as a plain limit, and the next request gets in).
    /// `view` was asked for at `read`.
    fn limited_by_ledger(
        &self,
        charge: &Charge<'_>,
        view: Result<Option<AccountView>, LedgerError>,
        read: Generation,
    ) -> (Outcome, LocalQuota) {
        let blocked = matches!(&view, Ok(Some(v)) if v.blocked.is_some());
        let (retry_after, listed) = self.retry_after(charge, view, read);
        let capacity = charge.account.capacity.get();
        let known = listed.is_some() || self.local.knows(charge.account.id);
        let local = listed.unwrap_or_else(|| {
            self.local
                .quota(charge.account.id, capacity, self.clock.now())
        });
        let quota = LocalQuota {
            // What is left when the view read it (less than this request's cost, but not
            // always 0: a local refusal says the same); 0 when it could not, or while blocked.
            remaining: match !blocked && known {
                true => local.remaining,
                false => 0,
            },
            // Never sooner than the retry: a block's end is when the caller's quota is back,
            // not its holds' expiry; and without a listing (the read failed, or found no
            // account) the local view may know nothing (a reset of 0, "whole now").
            reset_after: local.reset_after.max(retry_after.max(RETRY_AFTER_MIN)),
        };
        (refused(retry_after, DecisionSource::Ledger, blocked), quota)
    }

    fn fail(&self, error: LedgerError, charge: &Charge<'_>) -> (Outcome, LocalQuota) {
        self.log_failure(&error);
        let now = self.clock.now();
        if let Some(blocked) = self.known_block_refusal(charge.account.id, now) {
            return blocked;
        }
        let capacity = charge.account.capacity.get();
        let local = self.local.quota(charge.account.id, capacity, now);
        let outcome = match self.settings.failure_policy {
            FailurePolicy::Open => Outcome::FailedOpen(error),
            FailurePolicy::Closed => Outcome::FailedClosed(error),
        };
        (outcome, local)
    }

    /// The refusal of a caller whose block this instance read, while the block lasts: an
    /// operator's block stands while the ledger cannot be asked, whatever the failure policy.
    fn known_block_refusal(&self, account_id: u128, now: Instant) -> Option<(Outcome, LocalQuota)> {
        let block = self.local.known_block(account_id, now)?;
        let outcome = refused(block.retry_after, DecisionSource::LocalView, true);
        Some((outcome, block.quota))
    }

    /// On the request's span always; in the log at most once a second (an outage must not turn
    /// into a log flood).
    fn log_failure(&self, error: &LedgerError) {
        tracing::warn!(target: crate::telemetry::SPAN_EVENTS_TARGET, %error, "ledger could not decide");
        if crate::telemetry::log_throttle(&FAILURE_LOGGED_SECOND) {
            tracing::warn!(%error, policy = ?self.settings.failure_policy, "ledger could not decide; applying the failure policy (logged at most once a second)");
        }
    }

    /// When enough credit comes back, from what the ledger said of the account; remembered, so the
    /// next requests of this exhausted caller are answered locally. If the ledger could not say
    /// within the deadline, the caller's own plan's hold (its window, and L on a lease plan):
    /// the longest of every plan's told a caller on a plan of a second to come back in a day
    /// when another plan's window is a day (its next request asks the ledger again anyway).
    fn retry_after(
        &self,
        charge: &Charge<'_>,
        view: Result<Option<AccountView>, LedgerError>,
        read: Generation,
    ) -> (Duration, Option<LocalQuota>) {
        let view = lease::listing_settling_soon(view, charge.plan.lease(), self.clock.wall());
        let hold_max = self.hold_max();
        // A moved caller's account carries holds of its old plan's (their remaining time).
        let own = match charge.plan_id == charge.home_plan_id {
            true => own_hold(charge.account.window_seconds, charge.plan.lease()),
            false => hold_max,
        };
        let holds = (hold_max, own);
        self.retry_after_for(charge.account.id, charge.cost, holds, (view, read))
    }

    /// [`Limiter::retry_after`] for `cost` units of account `id`, whose holds last at most
    /// `window_max` (its own plan's, `own`), from a listing asked for at its generation; with
    /// the quota the listing says, when it refuses `cost` (whether the local view stored it or
    /// not). Without a listing, its own plan's hold.
    fn retry_after_for(
        &self,
        id: u128,
        cost: u64,
        (window_max, own): (Duration, Duration),
        (view, read): (Result<Option<AccountView>, LedgerError>, Generation),
    ) -> (Duration, Option<LocalQuota>) {
        let fallback = own.min(window_max) + self.settings.expiry_margin;
        match view {
            Ok(Some(view)) => {
                let now = self.clock.now();
                let listing = Listing { view: &view, read };
                let wall = self.clock.wall();
                match self.local.replace(id, listing, cost, window_max, now, wall) {
                    Some(limit) => (limit.retry_after, Some(limit.quota)),
                    // Holds expired between the two calls (credit is back already), or the view
                    // is off.
                    None => (Duration::ZERO, None),
                }
            }
            Ok(None) => (fallback, None),
            Err(error) => {
                tracing::debug!(%error, "could not read holds; Retry-After falls back to the window");
                (fallback, None)
            }
        }
    }

    /// Counts the decision and records it on the request's span (only when traced: the key id
    /// costs a hash).
    fn record(&self, decision: &Decision<'_>, key: &CallerKey, cost: NonZeroU64) {
        let label = DecisionLabel::of(&decision.outcome);
        let source = SourceLabel::of(&decision.outcome);
        self.decisions.record(label, Some(decision.plan_id), source);
        let span = tracing::Span::current();
        if !self.span_fields || span.is_disabled() {
            return;
        }
        let account_id = format_args!("{:032x}", decision.account_id);
        span.record(fields::USER_ID, tracing::field::display(account_id));
        span.record(fields::KEY_ID, tracing::field::display(key.key_id()));
        span.record(fields::PLAN, decision.plan.name());
        span.record(fields::COST, cost.get());
        span.record(fields::DECISION, label.as_str());
        span.record(fields::SOURCE, source.as_str());
        span.record(fields::REMAINING, decision.quota.remaining);
    }
}

/// A decision on the caller's plan alone, as [`Limiter::check`] gives it.
fn decision<'a>(
    charge: &Charge<'a>,
    outcome: Outcome,
    local: LocalQuota,
    hold: Option<HoldReceipt>,
    leased: Option<LeaseReceipt>,
) -> Decision<'a> {
    Decision {
        outcome,
        hold,
        leased,
        quota: Quota {
            limit: charge.account.capacity.get(),
            window_seconds: charge.account.window_seconds.get(),
            // A top-up can leave more than the plan's capacity: the fields show the policy's
            // quota at most, so that `r` never exceeds `q` (nor Remaining the Limit).
            remaining: local.remaining.min(charge.account.capacity.get()),
            reset_seconds: whole_seconds_up(local.reset_after),
        },
        account_id: charge.account.id,
        plan_id: charge.plan_id,
        plan: charge.plan,
        route_limits: Vec::new(),
        refused_by: None,
    }
}

/// The shortest `Retry-After` a refusal says (`refused` rounds up to it).
const RETRY_AFTER_MIN: Duration = Duration::from_secs(1);

/// [`plan::hold_seconds`] as a duration.
fn own_hold(window_seconds: std::num::NonZeroU32, lease: Option<plan::LeaseTerms>) -> Duration {
    Duration::from_secs(plan::hold_seconds(window_seconds, lease).into())
}

/// A refusal from this instance's memory ([`LocalLimit`]).
fn refused_from_memory(limit: LocalLimit) -> (Outcome, LocalQuota) {
    let outcome = refused(limit.retry_after, DecisionSource::LocalView, limit.blocked);
    (outcome, limit.quota)
}

fn refused(retry_after: Duration, source: DecisionSource, blocked: bool) -> Outcome {
    let retry_after_seconds = retry_after_seconds(retry_after);
    if blocked {
        Outcome::Blocked {
            retry_after_seconds,
            source,
        }
    } else {
        Outcome::Limited {
            retry_after_seconds,
            source,
        }
    }
}

/// Why a hold refused with `exceeds_credits` deserves one more try.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SecondChance {
    /// The account exists but its grant has not landed yet: another request is provisioning this
    /// new caller right now. Provisioning is idempotent, so finish it here too (then the grant is
    /// surely committed), and hold again.
    FinishProvisioning,
    /// Credit came back (or was granted) between the two calls: the ledger would admit now.
    CreditIsBack,
}

fn moved_to(view: &Result<Option<AccountView>, LedgerError>) -> Option<u64> {
    match view {
        Ok(Some(view)) => view.blocked.and_then(|closed| closed.moved_to),
        _ => None,
    }
}

fn second_chance(
    view: &Result<Option<AccountView>, LedgerError>,
    cost: u64,
) -> Option<SecondChance> {
    match view {
        // Never credited: the grant did not land (another instance's provisioning in flight,
        // or its grant failed). An account reduced to 0 by an operator is spent, not new: it
        // was provisioned again, for nothing, at its first request after each operator action.
        Ok(Some(v)) if !v.granted => Some(SecondChance::FinishProvisioning),
        Ok(Some(v)) if v.available >= cost => Some(SecondChance::CreditIsBack),
        _ => None,
    }
}
