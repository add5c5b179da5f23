//! Callers an operator moved to another plan (see [`crate::ledger::moves`]). The ledger is the
//! record; this instance remembers the moves it has learnt, so a moved caller costs one extra
//! round trip per instance, once, and nothing on the path of callers never moved.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::RwLock;

use super::plan::{PlanBook, PlanId};
use crate::ledger::model;

/// How many moved callers an instance remembers; past that it forgets them all (each then pays
/// its extra round trip again).
pub const MOVES_REMEMBERED_MAX: usize = 65_536;
/// How many moves one decision or lookup follows: one per plan of `plans`. Why: the moves from a
/// caller's home account never pass through a plan twice (a move back reopens the account it
/// left), so the whole chain has fewer hops than there are plans. A fixed bound of 3 left a
/// caller moved four times unmovable (`LostTrack`), unfound by a lookup, and refused as blocked
/// at its first request on each new instance. A longer walk means moves made while it walked.
pub fn moves_followed_max(plans: &super::PlanBook) -> usize {
    plans.plans().len()
}

/// Home account (the one its configured plan derives) → the plan it moved to.
#[derive(Default)]
pub struct Moves {
    moved: RwLock<HashMap<u128, PlanId>>,
    /// Whether any move is known: the common case skips the lock.
    any: AtomicBool,
}

impl Moves {
    pub fn get(&self, home_account_id: u128) -> Option<PlanId> {
        if !self.any.load(Ordering::Relaxed) {
            return None;
        }
        let moved = crate::sync::read(&self.moved);
        moved.get(&home_account_id).copied()
    }

    /// Remembers a move; moving back to the home plan forgets it.
    pub fn learn(&self, home_account_id: u128, plan: PlanId, home_plan: PlanId) {
        let mut moved = crate::sync::write(&self.moved);
        if plan == home_plan {
            moved.remove(&home_account_id);
            return;
        }
        if moved.len() >= MOVES_REMEMBERED_MAX {
            moved.clear();
        }
        moved.insert(home_account_id, plan);
        self.any.store(true, Ordering::Relaxed);
    }
}

/// The plan a move's [`model::plan_tag`] names, if this configuration has it.
pub fn plan_of_tag(plans: &PlanBook, tag: u64) -> Option<PlanId> {
    plans
        .plans()
        .iter()
        .position(|plan| model::plan_tag(plan.name()) == tag)
        .and_then(|index| plans.id_at(index))
}

/// Why a move was not made.
#[derive(Debug, thiserror::Error)]
pub enum MoveError {
    #[error("the key has no plan")]
    UnknownKey,
    #[error("there is no plan named {0:?}")]
    UnknownPlan(String),
    #[error("the caller is on plan {0:?} already")]
    SamePlan(String),
    #[error("the caller has no account yet (it has made no request)")]
    NoSuchAccount,
    #[error("the caller is blocked; unblock it first")]
    Blocked,
    /// The new plan's account for the caller is blocked (not the caller's own: a key that
    /// moved plans by the keys file left a block on its old plan's account). It answered
    /// "the caller is blocked", which no lookup of the caller could show or unblock.
    #[error("the caller's account on that plan, {account}, is blocked: unblock that account, or move the caller to another plan")]
    TargetBlocked { account: String },
    #[error("another move of the caller landed first; look it up, and move it again if need be")]
    MovedMeanwhile,
    #[error("the caller was moved to a plan this configuration does not have")]
    LostTrack,
    #[error(transparent)]
    Ledger(#[from] crate::ledger::LedgerError),
}

/// A move made.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MoveReport {
    pub from_account_id: String,
    pub from_plan: String,
    pub to_account_id: String,
    pub to_plan: String,
    /// Units of live holds carried to the new account.
    pub carried: u64,
}

impl super::Limiter {
    /// Moves the caller of `key` to plan `plan_name`, wherever earlier moves took it.
    pub async fn move_caller(
        &self,
        key: &super::CallerKey,
        plan_name: &str,
        actor: model::Actor,
        deadline: std::time::Instant,
    ) -> Result<MoveReport, MoveError> {
        use crate::ledger::Moving;
        let target = self
            .plans
            .by_name(plan_name)
            .ok_or_else(|| MoveError::UnknownPlan(plan_name.to_owned()))?;
        // Where this instance last found the caller (its charge follows the moves it learnt):
        // the ledger is read from there, not along the whole chain from its home again.
        let known = self
            .charge(key, std::num::NonZeroU64::MIN)
            .ok_or(MoveError::UnknownKey)?;
        let (from_plan, from) = self
            .current(key, known.plan_id, known.account.id, deadline)
            .await?;
        let plan = self.plan(target);
        let to = self.account_on(key, plan);
        if from_plan == target {
            return Err(MoveError::SamePlan(plan.name().to_owned()));
        }
        let account = model::UserAccount {
            id: to,
            capacity: plan.capacity(),
            window_seconds: plan.window_seconds(),
        };
        let tag = model::plan_tag(plan.name());
        // A lease lasts window + L: read back that far, or a lease that failed to settle (or
        // whose instance died) is not listed, and goes uncarried while its requests count.
        let hold_seconds_max = self.plans.hold_seconds_max().get();
        let ledger = &self.store;
        let carried = match ledger
            .move_caller(from, &account, tag, actor, hold_seconds_max, deadline)
            .await?
        {
            Moving::Done { carried } => carried,
            Moving::NoSuchAccount => return Err(MoveError::NoSuchAccount),
            Moving::Closed => return Err(MoveError::Blocked),
            Moving::TargetBlocked => {
                let account = format!("{to:032x}");
                return Err(MoveError::TargetBlocked { account });
            }
            Moving::MovedMeanwhile => return Err(MoveError::MovedMeanwhile),
        };
        self.local.forget(from);
        self.moves
            .learn(known.home_account_id, target, known.home_plan_id);
        Ok(MoveReport {
            from_account_id: format!("{from:032x}"),
            from_plan: self.plan(from_plan).name().to_owned(),
            to_account_id: format!("{to:032x}"),
            to_plan: plan.name().to_owned(),
            carried,
        })
    }

    fn plan(&self, id: PlanId) -> &super::Plan {
        self.plans.get(id).expect("an id from this book")
    }

    /// The caller's account now, following the moves the ledger records.
    async fn current(
        &self,
        key: &super::CallerKey,
        mut plan: PlanId,
        mut account: u128,
        deadline: std::time::Instant,
    ) -> Result<(PlanId, u128), MoveError> {
        let hold_seconds_max = self.plans.hold_seconds_max().get();
        for _ in 0..=moves_followed_max(&self.plans) {
            let view = self
                .store
                .account_view(account, hold_seconds_max, deadline)
                .await?;
            let Some(view) = view else {
                return Err(MoveError::NoSuchAccount);
            };
            match view.blocked.map(|closed| closed.moved_to) {
                None => return Ok((plan, account)),
                Some(None) => return Err(MoveError::Blocked),
                Some(Some(tag)) => {
                    plan = plan_of_tag(&self.plans, tag).ok_or(MoveError::LostTrack)?;
                    account = self.account_on(key, self.plan(plan));
                }
            }
        }
        Err(MoveError::LostTrack)
    }
}

/// How often an instance reads the ledger's operator epoch.
pub const OPERATOR_EPOCH_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

impl super::Limiter {
    /// Forever: reads the ledger's operator epoch every `interval` and, when an operator acted
    /// (anywhere, on any instance or from the command line), forgets what this instance knew of
    /// callers and settles its leases, so top-ups, blocks, unblocks and moves reach it within
    /// about `interval`. One lookup per
    /// interval per instance, whatever the traffic.
    pub async fn follow_operator_epoch(self: std::sync::Arc<Self>, interval: std::time::Duration) {
        let mut seen = None;
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let deadline = std::time::Instant::now() + interval;
            match self.store.operator_epoch(deadline).await {
                Ok(epoch) if seen.is_some_and(|seen| seen != epoch) => {
                    // A lease sent from now on, after the ledger answered this read, is stamped
                    // after the act the read saw (one sent while it was out may not be).
                    let answered_at = std::time::Instant::now();
                    self.local.clear(answered_at);
                    // A lease admits from memory: end those that may predate the act, so a block
                    // or a move takes effect here now rather than when each one's time runs out.
                    self.settle_leases_sent_before(Some(answered_at)).await;
                    seen = Some(epoch);
                }
                Ok(epoch) => seen = Some(epoch),
                // The ledger is away: its decisions fail by themselves; try again next tick.
                Err(error) => tracing::debug!(%error, "could not read the operator epoch"),
            }
        }
    }
}
