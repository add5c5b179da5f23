//! One request decided against several limits at once, front-end neutral: a key limited per
//! minute and per hour, an Envoy request with several descriptors, a user and a route limit.
//!
//! Every limit that costs something is one hold, and all of them are one linked chain
//! ([`Store::hold_chain`]): either every limit admits the request or none is charged, so a denied
//! request consumes nothing anywhere, and the limits are exact across any number of instances.
//! The branches are [`Limiter::check`]'s, per limit: the local view refuses an exhausted limit
//! without a ledger call; a new account is provisioned (each at most once per decision) and the
//! chain placed again; on `exceeds_credits` one second look at the refusing account decides between
//! one more attempt and a refusal; a ledger error follows the failure policy. One deadline covers
//! all of it.
//!
//! Unlike [`Limiter::check`], `check_all` counts nothing: the caller knows what its limits are
//! (plans, rules, descriptors) and labels its own metrics.

use std::time::{Duration, Instant};

use thiserror::Error;

use super::store::{Clock, Store};
use super::{
    refused, retry_after_seconds, second_chance, whole_seconds_up, DecisionSource, FailurePolicy,
    HoldReceipt, Limiter, Outcome, Quota, SecondChance, INCOMPLETE_LISTING_STANDS,
};
use crate::ledger::metrics::Operation;
use crate::ledger::model::UserAccount;
use crate::ledger::{AccountView, ChainLink, ChainReply, LedgerError, LinkRefusal, Roundtrip};
use crate::limiter::lease::listing_settling_soon;
use crate::limiter::local_view::{Check, Generation, Listing, LocalLimit, LocalQuota};
use crate::limiter::plan::LeaseTerms;

/// At most this many limits per decision (the ledger's chain bound).
pub const LIMITS_PER_CHECK_MAX: usize = crate::ledger::CHAIN_LINKS_MAX;

/// One limit a request is decided against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    /// The account that counts this limit (its capacity and window are the limit's).
    pub account: UserAccount,
    /// What the request costs on it. 0: a check (Envoy's `hits_addend` 0 on one descriptor):
    /// never held, refused when the account has nothing free or is closed.
    pub cost: u64,
    /// Whether this instance may remember the limit's holds and refuse locally. Off for limits
    /// whose holds other instances void early (concurrency slots): this instance's memory of them
    /// would then refuse what the ledger admits.
    pub local_view: bool,
    /// The lease terms of the plan whose account this is (a lease plan's, charged per request
    /// beside route limits): other instances' leases on it end when they settle them, not at
    /// their timeout, and a refusal's `Retry-After` and the local view say so
    /// (`lease::listing_settling_soon`).
    pub lease: Option<LeaseTerms>,
}

/// What one limit says of the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitStatus {
    pub quota: Quota,
    /// The hold the request placed on this limit (admitted, cost above 0): what a release voids.
    pub hold: Option<HoldReceipt>,
}

/// A decision against several limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MultiDecision {
    /// `Admitted` only if every limit admitted the request (then each costing limit holds).
    pub outcome: Outcome,
    /// The limit that refused (`Limited` only): its index in the request's limits.
    pub refused_by: Option<usize>,
    /// One status per limit, in the request's order.
    pub limits: Vec<LimitStatus>,
    /// The plan tag the refusing limit's account was moved to (it is closed by a move), as the
    /// ledger's refusal listed it: the HTTP front end follows the move without reading the
    /// account again.
    pub moved_to: Option<u64>,
}

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum LimitsError {
    #[error("a request is decided against at most {LIMITS_PER_CHECK_MAX} limits, not {0}")]
    TooMany(usize),
    #[error("two limits on one account disagree on its capacity or window")]
    Inconsistent,
}

/// How the chain came out once new accounts were provisioned and the second look was taken.
enum Chained {
    Held {
        roundtrip: Roundtrip,
        transfer_ids: Vec<u128>,
    },
    Refused {
        limit: usize,
        view: Result<Option<AccountView>, LedgerError>,
    },
    /// A link's account is closed (a block, a move) and the read that says why failed: the
    /// ledger said no, so refused, but for a second, not a window.
    ClosedUnread { limit: usize, error: LedgerError },
    /// A link's account refused, and listed a moment ago with more holds than a listing reads:
    /// refused for a second, as that listing had it, without listing it again.
    RefusedAsListed { limit: usize },
}

/// What a limit's account listed again said ([`Limiter::list_stale_again`]).
#[derive(Debug, Clone, Copy)]
enum Relisted {
    /// Still short: refused on the ledger's word just read.
    Short(LocalLimit),
    /// Room (or the account is gone): the ledger decides.
    Room,
    /// The listing failed: refused on the old word.
    Failed(LocalLimit),
}

impl<S: Store, C: Clock> Limiter<S, C> {
    /// Decides one request against every limit of `limits` (at most [`LIMITS_PER_CHECK_MAX`]):
    /// all hold, or none does. No limits: admitted, no ledger call. A limit that costs nothing is
    /// a check: its account is looked up, and refuses when nothing is free.
    pub async fn check_all(&self, limits: &[Limit]) -> Result<MultiDecision, LimitsError> {
        let deadline = self.deadline();
        self.check_all_by(limits, deadline).await
    }

    /// [`Limiter::check_all`] with every ledger call answered by `deadline`
    /// ([`Limiter::check_by`] says why).
    pub async fn check_all_by(
        &self,
        limits: &[Limit],
        deadline: Instant,
    ) -> Result<MultiDecision, LimitsError> {
        validate(limits)?;
        let started = self.clock.now();
        if let Some(refused) = self.refuse_locally(limits, started, &[]) {
            return Ok(refused);
        }
        // Limits refused on a word of the ledger's over `LISTING_TRUSTED_FOR` old are listed
        // again first (as a plain plan's are, `Limiter::listed_again`); still short, refused on
        // that word.
        let listed = self.list_stale_again(limits, started, deadline).await;
        if !listed.is_empty() {
            if let Some(refused) = self.refuse_locally(limits, self.clock.now(), &listed) {
                return Ok(refused);
            }
        }
        // Before any listing of an account is asked for (`LocalView::replace` says why).
        let reads = self.generations(limits);
        let checked = match self.refuse_checked(limits, &reads, deadline).await {
            Ok(checked) => checked,
            Err(refused) => return Ok(refused),
        };
        let mut decision = self.charge_all(limits, (started, &reads), deadline).await;
        if decision.outcome == Outcome::Admitted {
            // What a check read is the ledger's, not the view's guess (at most the limit: a
            // top-up can leave more free than it).
            for (i, available) in checked {
                let capacity = limits[i].account.capacity.get();
                decision.limits[i].quota.remaining = available.min(capacity);
            }
        }
        Ok(decision)
    }

    /// The chain of every limit that costs something: all hold, or none does.
    async fn charge_all(
        &self,
        limits: &[Limit],
        (started, reads): (Instant, &[Generation]),
        deadline: Instant,
    ) -> MultiDecision {
        let links: Vec<usize> = (0..limits.len()).filter(|i| limits[*i].cost > 0).collect();
        if links.is_empty() {
            return self.all_admitted(limits, &links, Roundtrip::at(started), &[]);
        }
        match self.chain(limits, &links, deadline).await {
            Ok(Chained::Held {
                roundtrip,
                transfer_ids,
            }) => self.all_admitted(limits, &links, roundtrip, &transfer_ids),
            Ok(Chained::Refused { limit, view }) => {
                let decision = self.refused_by_ledger(limits, limit, (view, reads[limit]));
                self.wait_for_every_spent_limit(decision, limits, reads, deadline)
                    .await
            }
            Ok(Chained::ClosedUnread { limit, error }) => {
                self.refused_closed_unread(limits, limit, error)
            }
            Ok(Chained::RefusedAsListed { limit }) => self.link_refused_as_listed(limits, limit),
            Err(error) => self.all_failed(limits, error),
        }
    }

    /// Forgets what this instance remembers of an account (its holds were given back by amount,
    /// not by receipt): its next request asks the ledger.
    pub fn forget(&self, account_id: u128) {
        self.local.forget(account_id);
    }

    /// Which of `limits` this instance remembers nothing of (it restarted, or the holds were
    /// placed elsewhere) and could remember: their quotas after a decision are guesses until
    /// [`Limiter::learn`]. A limit the local view has no room for (or with the view off) is not
    /// unknown: learning it would cost its reads on every request, for a quota it forgets.
    pub fn unknown_limits(&self, limits: &[Limit]) -> Vec<bool> {
        limits
            .iter()
            .map(|l| {
                let id = l.account.id;
                l.local_view && l.cost > 0 && !self.local.knows(id) && self.local.has_room_for(id)
            })
            .collect()
    }

    /// After an admitted decision, reads each `unknown` limit's account from the ledger (its
    /// credit and live holds, this request's included), so that this instance remembers it and
    /// the quota is the ledger's: a restarted instance reports the same remaining credit as
    /// before. Costs two reads per limit, once per caller and instance; on a ledger error the
    /// estimate stays. `deadline` is the decision's (the reads never make an answer later than it).
    pub async fn learn(
        &self,
        limits: &[Limit],
        unknown: &[bool],
        decision: &mut MultiDecision,
        deadline: Instant,
    ) {
        assert_eq!(limits.len(), unknown.len());
        assert_eq!(limits.len(), decision.limits.len());
        if decision.outcome != Outcome::Admitted || self.clock.now() >= deadline {
            return;
        }
        let generations = self.generations(limits);
        let reads = (0..limits.len())
            .filter(|i| unknown[*i])
            .map(|i| async move { (i, self.account_view_of(&limits[i].account, deadline).await) });
        for (i, view) in futures_util::future::join_all(reads).await {
            let Ok(Some(view)) = listing_settling_soon(view, limits[i].lease, self.clock.wall())
            else {
                continue;
            };
            let account = &limits[i].account;
            let now = self.clock.now();
            let window_max = self.window_max_of(account);
            let wall = self.clock.wall();
            let listing = Listing {
                view: &view,
                read: generations[i],
            };
            // Admitted: what the listing says free includes this request's hold, so `0` units
            // refuse nothing; the quota below is the view's (the listing's, once stored).
            self.local
                .replace(account.id, listing, 0, window_max, now, wall);
            let local = self.local.quota(account.id, account.capacity.get(), now);
            decision.limits[i].quota = quota(account, local);
        }
    }

    /// The limits this instance knows to be exhausted for the request's cost on their accounts:
    /// refused by the one that comes back last (a block first), so that waiting out its
    /// Retry-After finds every limit with room. The first one's, sooner, met another 429.
    /// A limit refused on a word of the ledger's over `LISTING_TRUSTED_FOR` old refuses only
    /// while another request lists it again, or once [`Self::list_stale_again`] said what it
    /// is (`listed`: the ledger's word just read, or the old one when the listing failed). Once
    /// one refuses, every limit's memory counts for the latest `Retry-After`.
    fn refuse_locally(
        &self,
        limits: &[Limit],
        now: Instant,
        listed: &[(usize, Relisted)],
    ) -> Option<MultiDecision> {
        let relisted = |index: usize| listed.iter().find(|(i, _)| *i == index).map(|(_, r)| *r);
        let cost_of = |limit: &Limit| cost_on_account(limits, limit.account.id);
        let refuses = limits.iter().enumerate().any(|(index, limit)| {
            let trusted = || {
                self.local
                    .check_trusted(limit.account.id, cost_of(limit), now, false)
            };
            match relisted(index) {
                Some(relisted) => !matches!(relisted, Relisted::Room),
                None => limit.local_view && matches!(trusted(), Check::Refuse(_)),
            }
        });
        if !refuses {
            return None;
        }
        let spent = limits
            .iter()
            .enumerate()
            .filter_map(|(index, limit)| match relisted(index) {
                Some(Relisted::Short(local)) => Some((index, (local, DecisionSource::Ledger))),
                Some(Relisted::Failed(local)) => Some((index, (local, DecisionSource::LocalView))),
                Some(Relisted::Room) => None,
                None if !limit.local_view => None,
                None => {
                    let local = self.local.check(limit.account.id, cost_of(limit), now)?;
                    Some((index, (local, DecisionSource::LocalView)))
                }
            });
        // The first of equals: the order the limits are configured in.
        let (index, (local, source)) = spent.max_by(|(a, (x, _)), (b, (y, _))| {
            let later = (x.blocked, x.retry_after).cmp(&(y.blocked, y.retry_after));
            later.then(b.cmp(a))
        })?;
        let mut statuses = self.local_statuses(limits, now);
        statuses[index].quota = quota(&limits[index].account, local.quota);
        Some(MultiDecision {
            outcome: refused(local.retry_after, source, local.blocked),
            refused_by: Some(index),
            limits: statuses,
            moved_to: None,
        })
    }

    /// Lists again, in place of their old listings, the accounts of `limits` whose word of the
    /// ledger's is over `LISTING_TRUSTED_FOR` old and that this request probes (one request at
    /// a time per account). Why: a hold voided on another instance frees credit an old listing
    /// counts as held. What each listing said (none: nothing to list).
    async fn list_stale_again(
        &self,
        limits: &[Limit],
        now: Instant,
        deadline: Instant,
    ) -> Vec<(usize, Relisted)> {
        let stale: Vec<(usize, u64, LocalLimit)> = (0..limits.len())
            .filter_map(|i| {
                let (limit, cost) = (&limits[i], cost_on_account(limits, limits[i].account.id));
                if !limit.local_view {
                    return None;
                }
                match self.local.check_trusted(limit.account.id, cost, now, true) {
                    Check::Probe(stale) => Some((i, cost, stale)),
                    Check::Ask | Check::Refuse(_) => None,
                }
            })
            .collect();
        // The common case (nothing stale): no generations read, nothing awaited.
        if stale.is_empty() {
            return Vec::new();
        }
        let reads = self.generations(limits);
        let listings = stale.iter().map(|&(i, cost, stale)| async move {
            let view = self.account_view_of(&limits[i].account, deadline).await;
            (i, cost, stale, view)
        });
        let mut relisted = Vec::with_capacity(stale.len());
        for (i, cost, stale, view) in futures_util::future::join_all(listings).await {
            let view = listing_settling_soon(view, limits[i].lease, self.clock.wall());
            let account = &limits[i].account;
            let said = match view {
                Ok(Some(view)) => {
                    let listing = Listing {
                        view: &view,
                        read: reads[i],
                    };
                    let window_max = self.window_max_of(account);
                    let (now, wall) = (self.clock.now(), self.clock.wall());
                    // Its answer whether stored or not (a change in its shard meanwhile).
                    let limit = self
                        .local
                        .replace(account.id, listing, cost, window_max, now, wall);
                    limit.map_or(Relisted::Room, Relisted::Short)
                }
                // Gone: what the ledger says of the chain, it says best.
                Ok(None) => {
                    self.local.forget(account.id);
                    Relisted::Room
                }
                Err(_) => Relisted::Failed(stale),
            };
            relisted.push((i, said));
        }
        relisted
    }

    /// The checks among `limits`: accounts that only costs of 0 name (Envoy's `hits_addend` 0,
    /// "check only"). Nothing is held for them, so the ledger is read: refused when the account
    /// is closed (a block) or has nothing free, as a charge of 1 would be; a missing account is
    /// whole. Read each time (the local view refuses sooner, above, but may not know what other
    /// instances charged), by one lookup: its holds are listed only for a refusal's
    /// `Retry-After`. A failed read is the failure policy's.
    ///
    /// `Ok`: what each check found free (its index, its units).
    async fn refuse_checked(
        &self,
        limits: &[Limit],
        reads: &[Generation],
        deadline: Instant,
    ) -> Result<Vec<(usize, u64)>, MultiDecision> {
        let checked = (0..limits.len()).filter(|i| {
            let id = limits[*i].account.id;
            limits.iter().all(|l| l.account.id != id || l.cost == 0)
        });
        let lookups = checked.map(|i| async move {
            let account = &limits[i].account;
            let window_seconds_max = self.window_seconds_max_of(account);
            let found = (self.store)
                .account_free(account.id, window_seconds_max, deadline)
                .await;
            (i, found)
        });
        let found = futures_util::future::join_all(lookups).await;
        // A refusal first: a read that failed beside one the ledger answered "nothing free"
        // made the call the failure policy's, admitted under the open policy.
        let refusal = found.iter().find_map(|(i, found)| match found {
            Ok(Some(f)) if f.closed || f.available == 0 => Some((*i, f.closed)),
            _ => None,
        });
        if let Some((i, closed)) = refusal {
            let refused = self.refused_check(limits, (i, closed), reads[i], deadline);
            return Err(refused.await);
        }
        let mut free = Vec::new();
        for (i, found) in found {
            match found {
                Ok(Some(f)) => free.push((i, f.available)),
                Ok(None) => free.push((i, limits[i].account.capacity.get())),
                Err(error) => return Err(self.all_failed(limits, error)),
            }
        }
        Ok(free)
    }

    /// A check whose account has nothing free or is closed: refused, as the listing of its holds
    /// says until when (read before, at `read`); for a second, without a listing, if the
    /// account was listed a moment ago and holds more than a listing reads, or if the listing
    /// fails (the lookup said no a moment ago: refused whatever the policy).
    async fn refused_check(
        &self,
        limits: &[Limit],
        (i, closed): (usize, bool),
        read: Generation,
        deadline: Instant,
    ) -> MultiDecision {
        // A closed account is read for why (a block, or where the caller went).
        if !closed && self.listed_lately(&limits[i]) {
            return self.link_refused_as_listed(limits, i);
        }
        match self.account_view_of(&limits[i].account, deadline).await {
            Err(error) => self.refused_closed_unread(limits, i, error),
            // Freed since the lookup: refused all the same, as of the lookup (a second at least).
            view => self.refused_by_ledger(limits, i, (view, read)),
        }
    }

    /// Places the chain of `links` (indices into `limits`); provisions each new account once
    /// (whether the ledger said it is missing or that its grant has not landed yet) and gives each
    /// account one second look on `exceeds_credits`. Each round but the last provisions an account
    /// or spends an account's second look: `2 × links + 1` rounds at most.
    async fn chain(
        &self,
        limits: &[Limit],
        links: &[usize],
        deadline: Instant,
    ) -> Result<Chained, LedgerError> {
        let chain: Vec<ChainLink> = links.iter().map(|i| link(&limits[*i])).collect();
        let mut provisioned: Vec<u128> = Vec::with_capacity(links.len());
        // Each account gets one second look (a new caller races on every limit's account).
        let mut looked: Vec<u128> = Vec::with_capacity(links.len());
        let void_if_abandoned = self.void_late_holds;
        for _ in 0..2 * links.len() + 1 {
            let reply = self
                .store
                .hold_chain(chain.clone(), deadline, void_if_abandoned)
                .await?;
            let (index, refusal) = match reply {
                ChainReply::Held {
                    roundtrip,
                    transfer_ids,
                } => return self.held_chain(roundtrip, transfer_ids, links.len()),
                ChainReply::Refused { index, refusal } => (index, refusal),
            };
            let Some(&limit) = links.get(index) else {
                return Err(self.unexpected("a chain refused by a link it does not have"));
            };
            let account = &limits[limit].account;
            match refusal {
                LinkRefusal::AccountNotFound if !provisioned.contains(&account.id) => {
                    self.store.provision(account, deadline).await?;
                    provisioned.push(account.id);
                }
                LinkRefusal::AccountNotFound => {
                    return Err(self.unexpected("account not found right after provisioning"));
                }
                LinkRefusal::Closed => {
                    return match self.account_view_of(account, deadline).await {
                        Err(error) => Ok(Chained::ClosedUnread { limit, error }),
                        view => Ok(Chained::Refused { limit, view }),
                    };
                }
                LinkRefusal::ExceedsCredits if self.listed_lately(&limits[limit]) => {
                    return Ok(Chained::RefusedAsListed { limit });
                }
                LinkRefusal::ExceedsCredits => {
                    let window_seconds_max = self.window_seconds_max_of(account);
                    let read = (account.id, limits[limit].local_view);
                    let view = (self.refusal_read(read, window_seconds_max, deadline)).await;
                    let cost = cost_on_account(limits, account.id);
                    match second_chance(&view, cost) {
                        Some(SecondChance::FinishProvisioning)
                            if !provisioned.contains(&account.id) =>
                        {
                            self.store.provision(account, deadline).await?;
                            provisioned.push(account.id);
                        }
                        Some(SecondChance::CreditIsBack) if !looked.contains(&account.id) => {
                            looked.push(account.id);
                        }
                        _ => return Ok(Chained::Refused { limit, view }),
                    }
                }
            }
        }
        Err(self.unexpected("a chain not decided within its rounds"))
    }

    /// A chain the ledger held: one id per link, or the ledger answered what the model rules out.
    fn held_chain(
        &self,
        roundtrip: Roundtrip,
        transfer_ids: Vec<u128>,
        links: usize,
    ) -> Result<Chained, LedgerError> {
        if transfer_ids.len() != links {
            return Err(self.unexpected("a chain's ids do not match its links"));
        }
        Ok(Chained::Held {
            roundtrip,
            transfer_ids,
        })
    }

    /// The refusal by `limits[refused]`, whose account [`Self::listed_lately`]: for a second,
    /// as that listing had it, without listing it again.
    fn link_refused_as_listed(&self, limits: &[Limit], refused: usize) -> MultiDecision {
        let outcome = super::refused(INCOMPLETE_LISTING_STANDS, DecisionSource::Ledger, false);
        self.refused_for_a_moment(limits, refused, outcome)
    }

    /// Whether `limit`'s account was listed a moment ago and found holding more than a listing
    /// reads ([`Chained::RefusedAsListed`]).
    fn listed_lately(&self, limit: &Limit) -> bool {
        limit.local_view && self.listed_lately_incomplete(limit.account.id).is_some()
    }

    /// Each limit's account's generation in the local view, read before its listing is asked for.
    fn generations(&self, limits: &[Limit]) -> Vec<Generation> {
        limits
            .iter()
            .map(|limit| self.local.generation(limit.account.id))
            .collect()
    }

    /// The account's credit and holds, listed over the longest window of the plans or its own.
    async fn account_view_of(
        &self,
        account: &UserAccount,
        deadline: Instant,
    ) -> Result<Option<AccountView>, LedgerError> {
        let window_seconds_max = self.window_seconds_max_of(account);
        self.store
            .account_view(account.id, window_seconds_max, deadline)
            .await
    }

    /// [`Self::window_max_of`] in whole seconds, as a listing asks for it.
    fn window_seconds_max_of(&self, account: &UserAccount) -> u32 {
        let seconds = self.window_max_of(account).as_secs();
        u32::try_from(seconds).unwrap_or(u32::MAX)
    }

    /// How long `limit`'s account's holds last at most, and its own plan's hold (see
    /// `Limiter::retry_after_for`).
    fn holds_of(&self, limit: &Limit) -> (Duration, Duration) {
        let own = super::own_hold(limit.account.window_seconds, limit.lease);
        (self.window_max_of(&limit.account), own)
    }

    /// How long any hold of this account may last: its own window, or a plan's hold (a
    /// lease's window + L) if longer.
    fn window_max_of(&self, account: &UserAccount) -> Duration {
        let seconds = self
            .plans
            .hold_seconds_max()
            .get()
            .max(account.window_seconds.get());
        Duration::from_secs(seconds.into())
    }

    /// An answer of the ledger the model rules out: counted, and decided by the failure policy.
    fn unexpected(&self, message: &str) -> LedgerError {
        let error = LedgerError::Unexpected {
            operation: Operation::CreateTransfers,
            message: message.to_owned(),
        };
        self.store.record_error(&error);
        error
    }

    /// Every costing limit held (`transfer_ids[k]` is `links[k]`'s hold): remembered locally.
    fn all_admitted(
        &self,
        limits: &[Limit],
        links: &[usize],
        roundtrip: Roundtrip,
        transfer_ids: &[u128],
    ) -> MultiDecision {
        assert_eq!(links.len(), transfer_ids.len());
        let now = self.clock.now();
        let mut statuses = self.local_statuses(limits, now);
        for (limit, transfer_id) in links.iter().zip(transfer_ids) {
            let Limit {
                account,
                cost,
                local_view,
                lease: _,
            } = limits[*limit];
            let window = Duration::from_secs(account.window_seconds.get().into());
            let capacity = account.capacity.get();
            let status = &mut statuses[*limit];
            if local_view {
                let local = self
                    .local
                    .record_hold(account.id, capacity, cost, roundtrip, window, now);
                status.quota = quota(&account, local);
            } else {
                status.quota.remaining = capacity.saturating_sub(cost);
                status.quota.reset_seconds = window.as_secs();
            }
            status.hold = Some(HoldReceipt {
                transfer_id: *transfer_id,
                amount: cost,
                expires_at: roundtrip.answered_at + window + self.settings.expiry_margin,
            });
        }
        same_account_same_quota(limits, links, &mut statuses);
        MultiDecision {
            outcome: Outcome::Admitted,
            refused_by: None,
            limits: statuses,
            moved_to: None,
        }
    }

    /// A chain stops at its first link without credit, and says nothing of the links after it:
    /// a request refused by a limit that comes back soon was told to retry then, and met the
    /// next spent limit's 429. The links after the refused one are looked up too (one lookup
    /// each, at once, by the decision's deadline), and those without room for the request are
    /// listed (their listings teach the local view, which then refuses by the latest of them);
    /// the refusal is by the one that comes back last. A block stays the answer.
    async fn wait_for_every_spent_limit(
        &self,
        mut decision: MultiDecision,
        limits: &[Limit],
        reads: &[Generation],
        deadline: Instant,
    ) -> MultiDecision {
        let (Some(refused), Outcome::Limited { .. }) = (decision.refused_by, &decision.outcome)
        else {
            return decision;
        };
        let later = (refused + 1..limits.len())
            .filter(|i| limits[*i].local_view && limits[*i].cost > 0)
            .filter(|i| {
                limits[..=refused]
                    .iter()
                    .all(|l| l.account.id != limits[*i].account.id)
            });
        // Listed only where this view would keep the listing: else each refusal would pay it
        // again (the refusal then names the refusing link, as before).
        let now = self.clock.now();
        let later = later.filter(|i| self.local.can_keep(limits[*i].account.id, now));
        let spent = later.map(|i| async move {
            let limit = &limits[i];
            let cost = cost_on_account(limits, limit.account.id);
            let window_seconds_max = self.window_seconds_max_of(&limit.account);
            let free = (self.store)
                .account_free(limit.account.id, window_seconds_max, deadline)
                .await;
            // Only what the ledger says: an unread limit lengthens nothing.
            match free {
                // Kept by the view (filtered above): listed in full.
                Ok(Some(free)) if !free.closed && free.available < cost => {
                    Some((i, self.account_view_of(&limit.account, deadline).await))
                }
                _ => None,
            }
        });
        let spent = futures_util::future::join_all(spent).await;
        for (i, view) in spent.into_iter().flatten() {
            self.refuse_by_later_limit(&mut decision, limits, i, (view, reads[i]));
        }
        decision
    }

    /// Makes limit `i` (its listing `view`) the refusal's, if it comes back later than the one
    /// that refused.
    fn refuse_by_later_limit(
        &self,
        decision: &mut MultiDecision,
        limits: &[Limit],
        i: usize,
        (view, read): (Result<Option<AccountView>, LedgerError>, Generation),
    ) {
        let Ok(Some(view)) = view else { return };
        let limit = &limits[i];
        let cost = cost_on_account(limits, limit.account.id);
        let holds = self.holds_of(limit);
        let view = listing_settling_soon(Ok(Some(view)), limit.lease, self.clock.wall());
        let (retry_after, spent) =
            self.retry_after_for(limit.account.id, cost, holds, (view, read));
        let Some(spent) = spent else { return };
        let Outcome::Limited {
            retry_after_seconds,
            ..
        } = decision.outcome
        else {
            return;
        };
        if super::retry_after_seconds(retry_after) <= retry_after_seconds {
            return;
        }
        decision.outcome = super::refused(retry_after, DecisionSource::Ledger, false);
        decision.refused_by = Some(i);
        let status = &mut decision.limits[i].quota;
        *status = quota(&limit.account, spent);
        status.remaining = status.remaining.min(cost.saturating_sub(1));
        status.reset_seconds = status
            .reset_seconds
            .max(super::retry_after_seconds(retry_after));
    }

    /// Limit `refused` has too little credit: nothing was held. Retry-After from its holds, as
    /// its listing (asked for at its generation) says.
    fn refused_by_ledger(
        &self,
        limits: &[Limit],
        refused: usize,
        (view, read): (Result<Option<AccountView>, LedgerError>, Generation),
    ) -> MultiDecision {
        let limit = &limits[refused];
        let cost = cost_on_account(limits, limit.account.id);
        // Closed by an operator (a block, or a move this front end does not follow).
        let blocked = matches!(&view, Ok(Some(v)) if v.blocked.is_some());
        let moved_to = super::moved_to(&view);
        let (retry_after, listed) = if limit.local_view {
            let holds = self.holds_of(limit);
            let view = listing_settling_soon(view, limit.lease, self.clock.wall());
            self.retry_after_for(limit.account.id, cost, holds, (view, read))
        } else {
            // Not remembered: a concurrency limit's slot, which comes back as soon as a call in
            // flight ends (its window is only the safety timeout of one never released). A
            // second, as the HTTP middleware says for a slot: the window (an hour, say) told
            // callers to wait that long for what any moment may free.
            (Duration::from_secs(1), None)
        };
        let now = self.clock.now();
        let mut statuses = self.local_statuses(limits, now);
        // What is left, as its listing says (under the cost: it was refused), as a refusal from
        // memory says next (`r=0` here and `r=2` there misled a client of a costly route): the
        // listing's own quota, which the view may not have kept (full, or changed meanwhile).
        // 0 when blocked, or with no listing.
        let status = &mut statuses[refused].quota;
        match listed.filter(|_| !blocked) {
            Some(listed) => {
                *status = quota(&limit.account, listed);
                status.remaining = status.remaining.min(cost.saturating_sub(1));
            }
            None => status.remaining = 0,
        }
        // No sooner than the Retry-After the outcome says (with no listing to wait for, it said
        // `t=0` beside `Retry-After: 1`).
        statuses[refused].quota.reset_seconds = statuses[refused]
            .quota
            .reset_seconds
            .max(retry_after_seconds(retry_after));
        MultiDecision {
            outcome: super::refused(retry_after, DecisionSource::Ledger, blocked),
            refused_by: Some(refused),
            limits: statuses,
            moved_to,
        }
    }

    /// The refusal of a request whose link `refused` found its account closed (a block, a
    /// move), or a check that found nothing free, when the read of why (or until when) failed:
    /// the block this instance knows, else refused for a second
    /// ([`CLOSED_UNREAD_RETRY`](super::CLOSED_UNREAD_RETRY)).
    fn refused_closed_unread(
        &self,
        limits: &[Limit],
        refused: usize,
        error: LedgerError,
    ) -> MultiDecision {
        tracing::debug!(%error, "an account the ledger refused could not be read; refused for a second");
        let now = self.clock.now();
        let id = limits[refused].account.id;
        let known = limits[refused].local_view;
        let outcome = match known.then(|| self.known_block_refusal(id, now)).flatten() {
            Some((outcome, _)) => outcome,
            None => super::refused(super::CLOSED_UNREAD_RETRY, DecisionSource::Ledger, false),
        };
        self.refused_for_a_moment(limits, refused, outcome)
    }

    /// A refusal by `limits[refused]` that this instance does not list the account for: the
    /// others' quotas as remembered, the refuser's at 0.
    fn refused_for_a_moment(
        &self,
        limits: &[Limit],
        refused: usize,
        outcome: Outcome,
    ) -> MultiDecision {
        let now = self.clock.now();
        let mut statuses = self.local_statuses(limits, now);
        statuses[refused].quota.remaining = 0;
        // Never sooner than the retry: the view may know nothing of the account (a reset of 0,
        // "whole now").
        if let Outcome::Limited {
            retry_after_seconds,
            ..
        }
        | Outcome::Blocked {
            retry_after_seconds,
            ..
        } = outcome
        {
            let reset = &mut statuses[refused].quota.reset_seconds;
            *reset = (*reset).max(retry_after_seconds);
        }
        MultiDecision {
            outcome,
            refused_by: Some(refused),
            limits: statuses,
            moved_to: None,
        }
    }

    fn all_failed(&self, limits: &[Limit], error: LedgerError) -> MultiDecision {
        self.log_failure(&error);
        let now = self.clock.now();
        let blocked = limits.iter().enumerate().find_map(|(i, limit)| {
            let refusal = limit
                .local_view
                .then(|| self.known_block_refusal(limit.account.id, now));
            refusal.flatten().map(|(outcome, _)| (i, outcome))
        });
        if let Some((i, outcome)) = blocked {
            // Its fields as any refusal's: the view's quota of a blocked caller said its credit
            // was free (`r=q;t=0`, before its Retry-After).
            return self.refused_for_a_moment(limits, i, outcome);
        }
        let outcome = match self.settings.failure_policy {
            FailurePolicy::Open => Outcome::FailedOpen(error),
            FailurePolicy::Closed => Outcome::FailedClosed(error),
        };
        MultiDecision {
            outcome,
            refused_by: None,
            limits: self.local_statuses(limits, now),
            moved_to: None,
        }
    }

    /// What this instance knows of each limit (its whole capacity if nothing).
    fn local_statuses(&self, limits: &[Limit], now: Instant) -> Vec<LimitStatus> {
        limits
            .iter()
            .map(|limit| {
                let capacity = limit.account.capacity.get();
                let local = if limit.local_view {
                    self.local.quota(limit.account.id, capacity, now)
                } else {
                    LocalQuota {
                        remaining: capacity,
                        reset_after: Duration::ZERO,
                    }
                };
                LimitStatus {
                    quota: quota(&limit.account, local),
                    hold: None,
                }
            })
            .collect()
    }
}

fn validate(limits: &[Limit]) -> Result<(), LimitsError> {
    if limits.len() > LIMITS_PER_CHECK_MAX {
        return Err(LimitsError::TooMany(limits.len()));
    }
    for (index, a) in limits.iter().enumerate() {
        let inconsistent = limits[..index].iter().any(|b| {
            b.account.id == a.account.id
                && (b.account.capacity != a.account.capacity
                    || b.account.window_seconds != a.account.window_seconds
                    || b.local_view != a.local_view)
        });
        if inconsistent {
            return Err(LimitsError::Inconsistent);
        }
    }
    Ok(())
}

/// Limits of one request on one account (the same descriptor twice) say what the account has
/// left after all of their holds: each said what was left after its own, the first one unit
/// more than the account had. The last link's quota (recorded after every hold) is the
/// account's; without a local view, the capacity less every cost on the account.
fn same_account_same_quota(limits: &[Limit], links: &[usize], statuses: &mut [LimitStatus]) {
    for &link in links {
        let account = limits[link].account;
        let Some(&last) =
            (links.iter().rev()).find(|&&other| limits[other].account.id == account.id)
        else {
            continue;
        };
        let mut quota = statuses[last].quota;
        if !limits[last].local_view {
            let cost = cost_on_account(limits, account.id);
            quota.remaining = account.capacity.get().saturating_sub(cost);
        }
        statuses[link].quota = quota;
    }
}

/// What one request charges `account_id` across its limits: two limits may share an account
/// (the same descriptor twice). At least 1: a check (a cost of 0) asks for a unit to be free.
pub fn cost_on_account(limits: &[Limit], account_id: u128) -> u64 {
    limits
        .iter()
        .filter(|l| l.account.id == account_id)
        .fold(0u64, |sum, l| sum.saturating_add(l.cost))
        .max(1)
}

fn link(limit: &Limit) -> ChainLink {
    assert!(limit.cost > 0);
    ChainLink {
        account_id: limit.account.id,
        amount: limit.cost,
        timeout_seconds: limit.account.window_seconds.get(),
    }
}

fn quota(account: &UserAccount, local: LocalQuota) -> Quota {
    Quota {
        limit: account.capacity.get(),
        window_seconds: account.window_seconds.get(),
        // At most the limit, whatever a top-up left (as a plan's quota).
        remaining: local.remaining.min(account.capacity.get()),
        reset_seconds: whole_seconds_up(local.reset_after),
    }
}
