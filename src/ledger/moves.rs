//! Moving a caller to another plan, in the ledger: the account of the plan it leaves is closed for
//! good by a [`TRANSFER_CODE_MOVE`](model::TRANSFER_CODE_MOVE) transfer that names the new plan,
//! and its live holds are carried to the new account for the rest of their timeouts, all in one
//! linked chain: a move either happens whole or not at all, and gives the caller no fresh credit.
//!
//! Requests that find the old account closed read where the caller went and follow; a moved
//! caller costs nothing more once an instance has learnt the move.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use tb::error::CreateTransferErrorKind;
use tigerbeetle_unofficial as tb;

use super::connection::Connection;
use super::metrics::Operation;
use super::model::{self, Actor, UserAccount};
use super::{client_error, nothing_if_abandoned, unexpected_transfer, Ledger, LedgerError, Place};
use crate::outstanding::OutGuard;
use crate::sync::lock;

/// At most this many carried holds per move (holds are grouped by the second they expire in,
/// and the latest groups merged, which only holds longer): a chain fits one request.
pub const CARRIED_LINKS_MAX: usize = 200;

/// How often a move whose answer was lost is looked for on the account it closes.
const LOST_MOVE_LOOK_INTERVAL: Duration = Duration::from_millis(100);

/// How long a move's second pass that failed waits before it is sent again, in the background:
/// at first, then twice as long each time, up to the most.
const SECOND_PASS_RETRY_INTERVAL: Duration = Duration::from_secs(1);
const SECOND_PASS_RETRY_INTERVAL_MAX: Duration = Duration::from_secs(30);

/// What a move came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Moving {
    /// Moved; `carried` units of live holds went along (at most what the new account had free).
    Done {
        carried: u64,
    },
    NoSuchAccount,
    /// The account it would leave is blocked.
    Closed,
    /// The account it would leave was moved already (another operator's move, meanwhile).
    MovedMeanwhile,
    /// The account it would go to is blocked.
    TargetBlocked,
}

/// Live holds as (amount, seconds left), grouped by second and bounded. A hold of nothing (a
/// balancing carry or recharge onto an account with nothing free) carries nothing: a carry of 0
/// is no hold to build.
fn carried_holds(holds: &[super::Hold], now: SystemTime) -> Vec<(u64, u32)> {
    let mut by_second: BTreeMap<u32, u64> = BTreeMap::new();
    for hold in holds.iter().filter(|hold| hold.amount > 0) {
        let left = hold.expires_at.duration_since(now).unwrap_or_default();
        let seconds = u32::try_from(left.as_secs() + 1).unwrap_or(u32::MAX);
        *by_second.entry(seconds).or_default() += hold.amount;
    }
    let mut carried: Vec<(u64, u32)> = by_second.into_iter().map(|(s, a)| (a, s)).collect();
    while carried.len() > CARRIED_LINKS_MAX {
        let (amount, _) = carried.remove(carried.len() - 2);
        carried.last_mut().expect("two or more").0 += amount;
    }
    carried
}

/// What a move carries of `view`: its live holds ([`carried_holds`]) and the credit held by holds
/// it did not list, carried as long as the longest listed hold lives (or a whole window when
/// none was listed). Those are the account's oldest holds, so they end no later: the new plan
/// refuses until then, never admits what the old one held. Unlisted: past what a listing reads
/// (`!complete`; a fully spent plan of 5,000 moved with about 1,000 units fresh), or older than
/// its look-back of a window (a lease, held for window + L, whose settlement failed or whose
/// instance died), listed or not as `complete`. A hold that expired between the balance and the
/// listing is carried too: refusing more for a while, never admitting more.
///
/// `held` is the account's credit held, read after the listing ([`Ledger::held_after`]): read
/// before it, holds placed between the two reads were listed but not in it, and took their
/// share of what the listing left out (4,000 held, 3,000 of them unlisted, 200 placed meanwhile:
/// 4,000 carried where 4,200 were live, fresh credit on the new plan). Only listed holds live
/// past [`HOLD_EXPIRY_LAG`] by this host's clock count against it: one that expired since (by
/// the cluster's clock) holds nothing there, and subtracted, would hide as much unlisted.
fn carried_from(
    view: &super::AccountView,
    held: u64,
    now: SystemTime,
    window_seconds: u32,
) -> Vec<(u64, u32)> {
    let mut carried = carried_holds(&view.holds, now);
    let live_after = now + HOLD_EXPIRY_LAG;
    let listed: u64 = (view.holds.iter())
        .filter(|hold| hold.expires_at > live_after)
        .map(|hold| hold.amount)
        .sum();
    let unlisted = held.saturating_sub(listed);
    if unlisted > 0 {
        match carried.last_mut() {
            // Sorted by seconds: the last lives longest.
            Some((amount, _)) => *amount += unlisted,
            None => carried.push((unlisted, window_seconds)),
        }
    }
    carried
}

/// How far this host's clock may be off the cluster's, for a listed hold's expiry: one that ends
/// within it may have ended already.
const HOLD_EXPIRY_LAG: Duration = Duration::from_secs(1);

/// The carries of `carried` (sorted shortest first, as [`carried_holds`] gives them), longest
/// first. Why: each is a balancing debit, so when the new plan is smaller than what is carried,
/// the first carries take all it has free and the later ones hold nothing. Shortest first, the
/// new plan would admit again as soon as the shortest holds ended, while the old plan's longer
/// holds still counted: a move to a smaller plan handed out fresh credit within seconds.
/// Longest first, what is held at any instant is the most of the capacity the old holds still
/// alive can fill.
fn carry_transfers(from: u128, to: u128, ledger: u32, carried: &[(u64, u32)]) -> Vec<tb::Transfer> {
    (carried.iter().rev())
        .map(|(amount, seconds)| model::carry_transfer(to, from, ledger, *amount, *seconds))
        .collect()
}

/// Why the account a move would leave is closed: a block, or a move already made.
fn closed_as(closed: super::Blocked) -> Moving {
    match closed.moved_to {
        Some(_) => Moving::MovedMeanwhile,
        None => Moving::Closed,
    }
}

/// The holds `after` lists that `before` did not: those placed between the two reads. Told
/// apart by id, not by a difference of balances, in which a hold that expired between the reads
/// would hide as much of the new ones. Both listings read newest first, so a hold placed after
/// `before` is listed in `after` even when neither is complete. A lease settled in flight
/// leaves its settlement here while the lease's own carry still stands, and a hold placed
/// between `before`'s listing and the balance's second read (one round trip) is in the first
/// pass's unlisted credit too ([`carried_from`]): counted twice until they expire, which
/// refuses more, never admits more.
fn late_holds(before: &super::AccountView, after: &super::AccountView) -> Vec<super::Hold> {
    let seen: std::collections::HashSet<u128> = before.holds.iter().map(|hold| hold.id).collect();
    (after.holds.iter())
        .filter(|hold| !seen.contains(&hold.id))
        .copied()
        .collect()
}

impl Ledger {
    /// Moves the caller from account `from` to `to` (the new plan's account, provisioned here),
    /// recording the new plan's [`model::plan_tag`]. If `to` was closed by an earlier move away
    /// from it (a move back), it is reopened in the same chain; its own holds still count, so a
    /// move back may count some requests twice until they expire: fewer admitted, never more.
    ///
    /// Run in a task of its own, to its end: a move whose caller goes away (an operator's
    /// request dropped) still runs its second pass, where cut off between its chain and that
    /// pass, the holds of requests in flight at the move counted on no plan.
    pub async fn move_caller(
        &self,
        from: u128,
        to: &UserAccount,
        plan_tag: u64,
        actor: Actor,
        window_seconds_max: u32,
        deadline: Instant,
    ) -> Result<Moving, LedgerError> {
        use tracing::Instrument;
        let (ledger, to) = (self.clone(), *to);
        let (tag, seconds) = (plan_tag, window_seconds_max);
        let moved = async move {
            ledger
                .move_here(from, &to, (tag, actor), seconds, deadline)
                .await
        };
        let moved = super::keep_operator_action(moved).instrument(tracing::Span::current());
        match tokio::spawn(moved).await {
            Ok(moved) => moved,
            Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
            Err(_) => Err(LedgerError::Unexpected {
                operation: Operation::CreateTransfers,
                message: "the move's task was cancelled (the runtime stopping)".to_owned(),
            }),
        }
    }

    /// [`Ledger::move_caller`], in the caller's task.
    async fn move_here(
        &self,
        from: u128,
        to: &UserAccount,
        (plan_tag, actor): (u64, Actor),
        window_seconds_max: u32,
        deadline: Instant,
    ) -> Result<Moving, LedgerError> {
        let Some(view) = self
            .account_view(from, window_seconds_max, deadline)
            .await?
        else {
            return Ok(Moving::NoSuchAccount);
        };
        if let Some(closed) = view.blocked {
            return Ok(closed_as(closed));
        }
        // Read at once after the listing: a hold placed between the two counts in `held` as
        // unlisted and is a late hold of the second pass too (carried twice). Read after the
        // new account was made (several round trips), every request in that gap was.
        let held = self.held_after(from, &view, deadline).await?;
        let (mut chain, to_free) = match self
            .open_target(to, actor, window_seconds_max, deadline)
            .await?
        {
            Ok(target) => target,
            Err(moving) => return Ok(moving),
        };
        let carried = carried_from(&view, held, SystemTime::now(), window_seconds_max);
        chain.extend(carry_transfers(from, to.id, self.ledger_id, &carried));
        let move_transfer = model::move_transfer(from, self.ledger_id, plan_tag, actor);
        let move_id = move_transfer.id();
        chain.push(move_transfer);
        let carried_total: u64 = carried.iter().map(|(amount, _)| amount).sum();
        let second_pass = SecondPass::new(self, (from, to.id), view, window_seconds_max);
        let placed = (Place::Waited, deadline);
        let created = match (self.create_chain_or(chain, placed, Some(second_pass.if_late()))).await
        {
            Ok(created) => created,
            Err(error) => {
                let lost = (move_id, &second_pass);
                self.lost_move(from, lost, error, deadline).await?
            }
        };
        match created {
            None => {}
            // Closed since it was read: by a block, or another operator's move.
            Some(CreateTransferErrorKind::DebitAccountAlreadyClosed) => {
                let carries = !carried.is_empty();
                return self
                    .closed_meanwhile((from, to.id), carries, deadline)
                    .await;
            }
            // Another operator moved the caller back to `to` first (its void of the same move).
            Some(CreateTransferErrorKind::PendingTransferAlreadyVoided) => {
                return Ok(Moving::MovedMeanwhile);
            }
            Some(kind) => return Err(unexpected_transfer("move: ", kind)),
        }
        // Moved: the late pass has time of its own (the move's deadline may be spent by now, and
        // a call past it is not sent), and its failure is not the move's, which is done.
        let late = second_pass.run(super::follow_up_deadline(deadline)).await;
        // Moved, whatever became of the late holds: every instance must hear of it.
        self.bump_operator_epoch(deadline).await;
        // What the carries held: as much as they asked for, and no more than the new account
        // had free (each is a balancing debit).
        Ok(Moving::Done {
            carried: (carried_total + late).min(to_free),
        })
    }

    /// A move whose answer was lost (`error`) may have landed all the same: the account it
    /// closes tells. Landed (`Ok(None)`), the move goes on as if answered: its second pass
    /// carries the holds placed meanwhile. Without that, the operator saw an error, a retry found
    /// the caller moved, and the requests in flight at the move counted on no plan.
    ///
    /// A move sent before its answer was lost is found at once: a client answers one request
    /// of a session at a time, so the look-up comes back after it. One still waiting in the
    /// client when its deadline passed may go after the look-up (the client batches a look-up
    /// with one waiting ahead of it): it is looked for again, for a second after the answer was
    /// lost (until the deadline, if that is later). The move's own answer, come late meanwhile,
    /// says so too (a look-up waits behind the move in the client: a stalled ledger answers the
    /// move first).
    /// Not found by then, the move's own error, once every instance was told to look again (in
    /// case it lands unseen: their leases on the old account); the bump has time of its own. If
    /// it lands later, its answer runs the second pass in the background ([`SecondPass`]).
    async fn lost_move(
        &self,
        from: u128,
        (move_id, second_pass): (u128, &SecondPass),
        error: LedgerError,
        deadline: Instant,
    ) -> Result<Option<CreateTransferErrorKind>, LedgerError> {
        let follow_up = super::follow_up_deadline(deadline);
        let looked = async {
            loop {
                match self.latest_block(from, follow_up).await {
                    Ok(Some(closing)) if closing.id() == move_id => return true,
                    // Not there yet, or not read (its in-flight bound full): again while time is
                    // left.
                    _ if Instant::now() + LOST_MOVE_LOOK_INTERVAL < follow_up => {
                        tokio::time::sleep(LOST_MOVE_LOOK_INTERVAL).await;
                    }
                    _ => return false,
                }
            }
        };
        // The look-up goes over the same client, after the move: the move's own late answer
        // may come first.
        let found = tokio::select! {
            found = looked => found,
            () = second_pass.landed_late() => true,
        };
        if found || !second_pass.give_up() {
            tracing::info!(%error, "the move's answer was lost, but it landed: carrying on");
            return Ok(None);
        }
        self.bump_operator_epoch(deadline).await;
        Err(error)
    }

    /// Provisions the account a move goes to and reads it: the start of the move's chain (the
    /// void of the move that closed it, for a move back) and what it has free; or why the move
    /// cannot go there (a block).
    async fn open_target(
        &self,
        to: &UserAccount,
        actor: Actor,
        window_seconds_max: u32,
        deadline: Instant,
    ) -> Result<Result<(Vec<tb::Transfer>, u64), Moving>, LedgerError> {
        self.provision(to, deadline).await?;
        let Some(target) = self
            .account_view(to.id, window_seconds_max, deadline)
            .await?
        else {
            return Ok(Ok((Vec::new(), u64::MAX)));
        };
        let chain = match target.blocked {
            Some(b) if b.moved_to.is_some() => {
                let Some(moved) = self.latest_block(to.id, deadline).await? else {
                    return Ok(Err(Moving::TargetBlocked));
                };
                vec![model::unmove_transfer(moved.id(), self.ledger_id, actor)]
            }
            Some(_) => return Ok(Err(Moving::TargetBlocked)),
            None => Vec::new(),
        };
        Ok(Ok((chain, target.available)))
    }

    /// Why a move's chain found a debited account closed since it was read (`carries`: the
    /// chain carried holds). The carries debit the new account, ahead of the move's debit of the
    /// old: a new account blocked meanwhile failed the chain first, and was taken for the old
    /// one's refusal ("closed", or, for a caller once moved away and back, "moved meanwhile").
    async fn closed_meanwhile(
        &self,
        (from, to): (u128, u128),
        carries: bool,
        deadline: Instant,
    ) -> Result<Moving, LedgerError> {
        let follow_up = super::follow_up_deadline(deadline);
        if carries && self.is_closed(to, follow_up).await? {
            // Closed by a move away from it (another operator's move of the caller) or a block.
            return Ok(match self.closed_by_move(to, follow_up).await? {
                true => Moving::MovedMeanwhile,
                false => Moving::TargetBlocked,
            });
        }
        Ok(closed_as(self.closed_by(from, follow_up).await?))
    }

    /// Whether the account exists and is closed (a block, or a move away).
    async fn is_closed(&self, account_id: u128, deadline: Instant) -> Result<bool, LedgerError> {
        let account = self.lookup_account(account_id, deadline).await?;
        Ok(account.is_some_and(|account| account.flags().contains(tb::account::Flags::CLOSED)))
    }

    /// The credit `from` holds, read again after `view`'s listing ([`carried_from`] says why);
    /// `view`'s own if the account is gone meanwhile (the move then finds it so).
    async fn held_after(
        &self,
        from: u128,
        view: &super::AccountView,
        deadline: Instant,
    ) -> Result<u64, LedgerError> {
        let free = self.account_free(from, deadline).await?;
        let free = free.map_or((view.credit, view.available), |f| (f.credit, f.available));
        Ok(free.0.saturating_sub(free.1))
    }

    /// Holds placed on the old account between the read and the close (requests in flight at
    /// the move) are carried by a second pass, each for the rest of its own timeout: the old
    /// account is closed now, so this read is final.
    async fn carry_late_holds(
        &self,
        from: u128,
        to: u128,
        before: &super::AccountView,
        window_seconds_max: u32,
        deadline: Instant,
    ) -> Result<u64, LedgerError> {
        let Some(after) = self
            .account_view(from, window_seconds_max, deadline)
            .await?
        else {
            return Ok(0);
        };
        let late = carried_holds(&late_holds(before, &after), SystemTime::now());
        if late.is_empty() {
            return Ok(0);
        }
        let chain = carry_transfers(from, to, self.ledger_id, &late);
        match self.create_chain(chain, (Place::Waited, deadline)).await? {
            None => Ok(late.iter().map(|(amount, _)| amount).sum()),
            Some(kind) => Err(unexpected_transfer("move, late holds: ", kind)),
        }
    }

    /// Creates `transfers` as one linked chain (its place under the in-flight bound got as
    /// `place` says): `Ok(None)` when all were created, else the first failure's own reason
    /// (not `linked_event_failed`).
    pub(super) async fn create_chain(
        &self,
        transfers: Vec<tb::Transfer>,
        placed: (Place, Instant),
    ) -> Result<Option<CreateTransferErrorKind>, LedgerError> {
        (self.create_chain_or(transfers, placed, nothing_if_abandoned())).await
    }

    /// [`Ledger::create_chain`], with `on_abandoned` given the answer that came after the caller
    /// stopped waiting.
    async fn create_chain_or<A>(
        &self,
        mut transfers: Vec<tb::Transfer>,
        (place, deadline): (Place, Instant),
        on_abandoned: Option<A>,
    ) -> Result<Option<CreateTransferErrorKind>, LedgerError>
    where
        A: FnOnce(Arc<Connection>, &Result<Option<CreateTransferErrorKind>, LedgerError>)
            + Clone
            + Send
            + 'static,
    {
        let last = transfers.len() - 1;
        for transfer in &mut transfers[..last] {
            let flags = transfer.flags() | tb::transfer::Flags::LINKED;
            transfer.set_flags(flags);
        }
        self.call_placed(
            Operation::CreateTransfers,
            (place, deadline),
            move |client| async move {
                match client.create_transfers(transfers).await {
                    Ok(()) => Ok(None),
                    Err(tb::error::CreateTransfersError::Api(errors)) => {
                        Ok(errors.as_slice().iter().map(|e| e.kind()).find(|kind| {
                            !matches!(kind, CreateTransferErrorKind::LinkedEventFailed)
                        }))
                    }
                    Err(e) => Err(client_error(Operation::CreateTransfers, e)),
                }
            },
            on_abandoned,
        )
        .await
    }
}

/// A move's second pass: the holds placed on the old account between the move's read and its
/// close (requests in flight at the move), carried to the new account. Run once: by the move
/// itself once it knows it landed (answered, or found by [`Ledger::lost_move`], or answered
/// late while the move still looked for it), or in the background when the move's answer
/// comes after the move gave up on it (it landed unseen: the operator was told it failed, and a
/// retry finds the caller moved). A pass that fails is sent again in the background until it
/// lands or its holds would have expired: dropped, the holds counted on no plan and the new one
/// admitted that many more within their window.
#[derive(Clone)]
struct SecondPass(Arc<SecondPassState>);

struct SecondPassState {
    ledger: Ledger,
    from: u128,
    to: u128,
    /// The old account as the move read it.
    before: super::AccountView,
    window_seconds_max: u32,
    stage: Mutex<Stage>,
    /// Told when a late answer says the move landed while the move still looks for it.
    landed: tokio::sync::Notify,
}

/// Who runs a [`SecondPass`].
enum Stage {
    /// The move waits for its answer, or looks for itself after losing it.
    Waiting,
    /// The move's late answer says it landed, while the move still looks: the move runs it.
    LandedLate,
    /// The move gave up on itself: a late answer that it landed runs the pass. Counted out in
    /// [`Ledger::second_passes_done`] until then, or until no answer can come (the pass, and
    /// the guard with it, dropped: the call's task has ended, or it was never sent).
    GaveUp(OutGuard),
    /// Run, or running.
    Taken,
}

impl SecondPass {
    fn new(
        ledger: &Ledger,
        (from, to): (u128, u128),
        before: super::AccountView,
        window_seconds_max: u32,
    ) -> Self {
        SecondPass(Arc::new(SecondPassState {
            ledger: ledger.clone(),
            from,
            to,
            before,
            window_seconds_max,
            stage: Mutex::new(Stage::Waiting),
            landed: tokio::sync::Notify::new(),
        }))
    }

    /// Moves the stage to what `next` says of it (`None`: it stays), under the lock: the stage
    /// it left, if it moved.
    fn advance(&self, next: impl FnOnce(&Stage) -> Option<Stage>) -> Option<Stage> {
        let mut stage = lock(&self.0.stage);
        let moved = next(&stage)?;
        Some(std::mem::replace(&mut *stage, moved))
    }

    /// For the move's chain: its answer, come after the move stopped waiting for it.
    fn if_late(
        &self,
    ) -> impl FnOnce(Arc<Connection>, &Result<Option<CreateTransferErrorKind>, LedgerError>)
           + Clone
           + Send
           + 'static {
        let pass = self.clone();
        move |_, answer| {
            // Not landed: nothing to carry (a pass the move gave up on is let go as this
            // closure is dropped, [`Stage::GaveUp`]).
            if !matches!(answer, Ok(None)) {
                return;
            }
            let was = pass.advance(|stage| match stage {
                Stage::Waiting => Some(Stage::LandedLate),
                Stage::GaveUp(_) | Stage::Taken => Some(Stage::Taken),
                Stage::LandedLate => unreachable!("one answer per call"),
            });
            match was {
                Some(Stage::Waiting) => pass.0.landed.notify_one(),
                Some(Stage::GaveUp(out)) => {
                    tracing::warn!("a move whose answer was lost landed later: carrying the holds placed meanwhile");
                    pass.retry_later(out, true);
                }
                _ => {}
            }
        }
    }

    /// Until a late answer says the move landed, while the move looks for it.
    async fn landed_late(&self) {
        loop {
            let notified = self.0.landed.notified();
            if matches!(*lock(&self.0.stage), Stage::LandedLate) {
                return;
            }
            notified.await;
        }
    }

    /// The move gives up looking for itself: false if a late answer said it landed first (then
    /// it carries on as landed).
    fn give_up(&self) -> bool {
        // Its late answer may still come, and run the pass: counted out (under the stage's
        // lock, so no late answer can take it first), for a short-lived process to wait for.
        let second_passes = &self.0.ledger.second_passes;
        let gave_up = self.advance(|stage| {
            matches!(stage, Stage::Waiting).then(|| Stage::GaveUp(second_passes.count_out()))
        });
        gave_up.is_some()
    }

    /// The pass, within `deadline`, run by the move that knows it landed: the units it carried,
    /// 0 when it failed (then sent again in the background).
    async fn run(&self, deadline: Instant) -> u64 {
        let was = self.advance(|_| Some(Stage::Taken));
        debug_assert!(matches!(was, Some(Stage::Waiting | Stage::LandedLate)));
        match self.carry(deadline).await {
            Ok(carried) => carried,
            Err(error) => {
                tracing::warn!(%error, "moved, but the holds of requests in flight at the move were not carried yet: sent again in the background");
                self.retry_later(self.0.ledger.second_passes.count_out(), false);
                0
            }
        }
    }

    async fn carry(&self, deadline: Instant) -> Result<u64, LedgerError> {
        let state = &*self.0;
        (state.ledger)
            .carry_late_holds(
                state.from,
                state.to,
                &state.before,
                state.window_seconds_max,
                deadline,
            )
            .await
    }

    /// The pass, sent again (every second, then less often, up to every 30 s) until it lands or
    /// its holds would have expired (a pass whose answer was lost may have landed: sent again,
    /// its holds are held twice until they expire, which refuses more, never admits more).
    /// `bump`: a move that landed unseen; every instance is told of it first (its callers'
    /// requests then follow the move; the pass may take a while). Counted out (`out`) until its
    /// end, for [`Ledger::second_passes_done`].
    fn retry_later(&self, out: OutGuard, bump: bool) {
        let pass = self.clone();
        let window = Duration::from_secs(u64::from(self.0.window_seconds_max));
        let give_up_at = Instant::now() + window;
        // On the ledger's home runtime: the admin API's worker, whose runtime ran the move, is
        // stopped before the service ends, and the pass with it (its holds then counted on no
        // plan until they expired).
        let home = out.home().cloned();
        // An operator's action's end: its reads wait for a place under a full in-flight bound,
        // as the action's own did (refused at once, a flood made every try fail).
        let task = super::as_operator_action(async move {
            let ledger = &pass.0.ledger;
            if bump {
                ledger.bump_operator_epoch(Instant::now()).await;
            }
            let mut interval = SECOND_PASS_RETRY_INTERVAL;
            loop {
                let now = Instant::now();
                match pass.carry(super::follow_up_deadline(now)).await {
                    Ok(carried) => {
                        tracing::info!(
                            carried,
                            "the holds of requests in flight at a move were carried"
                        );
                        break;
                    }
                    Err(error) if now >= give_up_at => {
                        tracing::warn!(%error, "the holds of requests in flight at a move were not carried: they have expired since");
                        break;
                    }
                    Err(_) => tokio::time::sleep(interval).await,
                }
                interval = (interval * 2).min(SECOND_PASS_RETRY_INTERVAL_MAX);
            }
            drop(out);
        });
        match home {
            Some(home) => drop(home.spawn(task)),
            None => drop(tokio::spawn(task)),
        }
    }
}

impl Ledger {
    /// Whether every move's second pass still running in the background ended by `deadline`
    /// (false: some may not run, if this process ends now; their holds then count on no plan
    /// until they expire).
    pub async fn second_passes_done(&self, deadline: Instant) -> bool {
        let within = deadline.saturating_duration_since(Instant::now());
        self.second_passes.back(within).await == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A hold of `amount` that expires `ms` after `now` (its id made of both).
    fn hold_at(now: SystemTime, ms: u64, amount: u64) -> super::super::Hold {
        super::super::Hold {
            id: u128::from(ms) << 64 | u128::from(amount),
            amount,
            expires_at: now + Duration::from_millis(ms),
            leased_at: None,
        }
    }

    #[test]
    fn carried_holds_are_grouped_by_second_bounded_and_never_shorter() {
        let now = SystemTime::now();
        let hold = |ms, amount| hold_at(now, ms, amount);
        let holds = [hold(100, 1), hold(900, 2), hold(1500, 3)];
        assert_eq!(carried_holds(&holds, now), [(3, 1), (3, 2)]);
        let many: Vec<_> = (0..1000).map(|i| hold(i * 1000 + 10, 1)).collect();
        let carried = carried_holds(&many, now);
        assert_eq!(carried.len(), CARRIED_LINKS_MAX);
        assert_eq!(carried.iter().map(|c| c.0).sum::<u64>(), 1000);
        assert_eq!(carried.last().unwrap().1, 1000, "merged into the latest");
        // Holds of nothing (a move back onto an exhausted account) carry nothing.
        assert_eq!(carried_holds(&[hold(1500, 0)], now), []);
        assert_eq!(
            carried_holds(&[hold(1500, 0), hold(1600, 2)], now),
            [(2, 2)]
        );
    }

    #[test]
    fn what_a_listing_left_out_is_carried_as_long_as_the_longest_listed_hold() {
        let now = SystemTime::now();
        let hold = |ms, amount| hold_at(now, ms, amount);
        let spent =
            |available, holds: Vec<super::super::Hold>, complete| super::super::AccountView {
                credit: 5_000,
                granted: true,
                available,
                holds,
                complete,
                blocked: None,
            };
        let view = |holds, complete| spent(0, holds, complete);
        let carried = |view: &super::super::AccountView| {
            let held = view.credit - view.available;
            carried_from(view, held, now, 60)
        };
        let listed = vec![hold(1500, 3), hold(30_500, 4)];
        // All listed: what is listed, nothing more.
        assert_eq!(
            carried(&spent(4_993, listed.clone(), true)),
            [(3, 2), (4, 31)]
        );
        // A whole listing that misses held credit (a lease older than the look-back): carried.
        assert_eq!(carried(&view(listed.clone(), true)), [(3, 2), (4_997, 31)]);
        // 4,993 held but not listed: with the longest listed.
        assert_eq!(carried(&view(listed.clone(), false)), [(3, 2), (4_997, 31)]);
        // Nothing listed at all: a whole window.
        assert_eq!(carried(&view(vec![], false)), [(5_000, 60)]);
        // 4,000 held when the balance was read, 1,000 of them listed, and 200 placed before the
        // listing (listed too): read after the listing, 4,200 are held, and all are carried.
        let mut newer = vec![hold(30_500, 1_000)];
        newer.extend((0..200).map(|_| hold(59_500, 1)));
        let before = super::super::AccountView {
            credit: 5_000,
            available: 1_000,
            ..spent(0, newer, false)
        };
        let total =
            |carried: Vec<(u64, u32)>| carried.iter().map(|(amount, _)| amount).sum::<u64>();
        assert_eq!(total(carried_from(&before, 4_200, now, 60)), 4_200);
        assert_eq!(
            total(carried(&before)),
            4_000,
            "the balance read first fell short"
        );
        // A listed hold that may have expired since (by the cluster's clock) hides nothing: 10
        // held after the listing, 5 of them listed for 30 s, and 10 listed for 0.5 s, gone.
        let ending = vec![hold(500, 10), hold(30_500, 5)];
        assert_eq!(
            carried_from(&view(ending, false), 10, now, 60),
            [(10, 1), (10, 31)],
            "the 5 unlisted carried as long as the longest listed"
        );
    }

    #[test]
    fn a_hold_placed_in_flight_is_carried_though_another_expired_between_the_reads() {
        let now = SystemTime::now();
        let hold = |ms, amount| hold_at(now, ms, amount);
        let view = |holds: Vec<super::super::Hold>| super::super::AccountView {
            credit: 5,
            granted: true,
            available: 5 - holds.iter().map(|hold| hold.amount).sum::<u64>(),
            holds,
            complete: true,
            blocked: None,
        };
        // Read at the move: a hold about to expire, and one of 40 s.
        let before = view(vec![hold(50, 1), hold(40_000, 2)]);
        // Read after the close: the first expired, and a request in flight placed a hold of a
        // whole window. Both reads hold 3: a difference of balances carried nothing.
        let after = view(vec![hold(40_000, 2), hold(60_000, 1)]);
        assert_eq!(before.available, after.available);
        let late = late_holds(&before, &after);
        assert_eq!(carried_holds(&late, now), [(1, 61)], "for its own time");
        // Nothing placed in flight: nothing late, though one hold expired.
        let quiet = view(vec![hold(40_000, 2)]);
        assert_eq!(late_holds(&before, &quiet), []);
    }
}
