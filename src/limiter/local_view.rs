//! This instance's memory of callers' holds: enough to fill the rate-limit headers without a
//! second ledger round trip, and to answer 429 locally while a caller is known to be exhausted.
//!
//! Safety argument (why a local 429 is never wrong): the holds this instance knows of are a subset
//! of the account's holds, and each known hold's expiry is over-estimated (the reply time, not the
//! ledger timestamp, plus a margin for TigerBeetle's expiry lag). So `credit − known live holds` is
//! an upper bound on the ledger's available credit, as long as `credit` is the account's credit.
//! The plan's capacity is only a guess at that credit (an operator may have topped it up), so the
//! view refuses a caller only once the ledger itself has said what its account holds (a 429 from
//! the ledger), and forgets everything when an operator acts ([`LocalView::clear`], driven by the
//! ledger's operator epoch, read once a second): a top-up, an unblock or a move reaches every
//! instance within about a second. When a cost exceeds the bound, the ledger would answer
//! `exceeds_credits` too. The view only ever rejects; admitting is the ledger's alone.
//!
//! Bounded: at most `callers_max` callers, and at most [`HOLDS_PER_CALLER_MAX`] holds each (the
//! oldest two are merged, keeping the *earlier* expiry: the view may then count too little held,
//! which sends a request to the ledger, never too much, which would refuse one the ledger admits).
//! A full shard forgets callers with nothing live (no hold, no block), at most once until the
//! first of its callers' holds or blocks ends; a caller that finds no room is not remembered.
//!
//! Most requests are from callers the ledger has never refused, whom the view does not refuse:
//! a filter of bits by account id ([`VERIFIED_FILTER_BITS`]) answers their `check` without the
//! caller's shard. Why: with 10,000 callers in turn, the shard's lock, its table and the caller's
//! entry and holds were four cache misses, 0.6 to 0.7 µs of each admitted request under
//! `wrk -c64` (`perf`, BENCHMARKS.md, run W); the filter is 512 bytes that every worker reads
//! and only a refusal writes. The filter can only make the view refuse less: a clear bit sends
//! the caller to the ledger, which is what an unknown caller gets.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use crate::ledger::{AccountView, Roundtrip};
use crate::sync::lock;

pub const HOLDS_PER_CALLER_MAX: usize = 1024;
const SHARD_COUNT: usize = 64;
/// The shortest Retry-After of a cost above the whole credit.
const NEVER_FITS_RETRY_MIN: Duration = Duration::from_secs(1);
/// How long a block the ledger listed is refused from memory before the ledger is asked again.
/// An unblock reaches every instance through the operator epoch within a second; this bounds
/// how long an instance that missed it (a bump lost in a failover) goes on refusing, which was
/// up to the block's end (a week).
const BLOCK_TRUSTED_FOR: Duration = Duration::from_secs(60);

/// How long the ledger's word that a caller has no room (its listing) refuses it from memory
/// before one of its requests lists it again ([`LocalView::check_trusted`]). Why: a hold voided
/// on another instance (a refund, a late hold's void, a concurrency slot's give-back) frees
/// credit this instance's listing still counts as held, and it refused the caller from memory
/// until that hold's end, a window (an hour, on an hourly plan). A listing is reads, no
/// transfer (a refused hold would be stored: about 0.6 KB each), by one request per caller at
/// a time.
/// Five seconds, not one: a caller sending a request a second (k6's reference run) then had every
/// refusal listed again, and the view spared the ledger nothing.
pub const LISTING_TRUSTED_FOR: Duration = Duration::from_secs(5);

/// How long a probe (a caller's listing asked for again) may go unanswered before another
/// request probes again (its request may have been dropped, or the ledger failed it), at
/// least: a limiter sets the ledger's deadline if longer ([`LocalView::with_probe_pending`]),
/// or a slow ledger got a listing of the caller a second, all at once.
const PROBE_PENDING_MAX: Duration = Duration::from_secs(1);
/// Bits in the filter of callers the ledger may have verified: 512 bytes. A verified caller sets
/// its bit, and with it every other caller's that shares the bit (they then take the shard's
/// path, as every caller did before the filter). Bits are cleared with the view
/// ([`LocalView::clear`], at each operator action); until then every caller ever refused keeps
/// its bit set, so with thousands of them the filter saves less, and never refuses more.
pub const VERIFIED_FILTER_BITS: usize = 4096;
const VERIFIED_FILTER_WORDS: usize = VERIFIED_FILTER_BITS / 64;
/// Blocks a clear keeps for the failure policy ([`LocalView::clear`]); more are not kept.
pub const BLOCKS_KEPT_MAX: usize = 4096;

/// A block kept for the failure policy: until when, and when this instance learned it (a
/// listing, or an operator's act here). Word of the caller from before that is older.
#[derive(Debug, Clone, Copy)]
struct KeptBlock {
    until: Instant,
    learned_at: Instant,
}

/// What became of a listing ([`LocalView::store_listed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stored {
    Yes,
    /// Something it may predate happened in its shard since it was asked for.
    Stale,
    /// The shard is full of active callers.
    NoRoom,
}

/// What an operator's act here did to a caller's block ([`LocalView::forget_acted_on`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockAct {
    /// A retried act (a top-up applied before, a block already made): whatever block there was
    /// stands.
    Unchanged,
    /// Blocked until then.
    Blocked(Instant),
    /// Unblocked.
    Lifted,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LocalHold {
    amount: u64,
    expires_at: Instant,
}

#[derive(Debug, Clone)]
struct CallerHolds {
    /// The credit the account has when nothing is held (its grant, as the ledger last said).
    credit: u64,
    /// Known holds, earliest expiry first.
    holds: VecDeque<LocalHold>,
    held: u64,
    /// The latest expiry of any known hold: exact while `holds` is not empty (a hold is only
    /// pruned once everything in front of it expired, so the latest one goes last).
    latest_expiry: Option<Instant>,
    /// Whether the ledger has said what `credit` and `blocked_until` are (else `credit` is the
    /// plan's capacity, a guess, and the view does not refuse on it).
    verified: bool,
    /// Until when an operator blocked the caller, as the ledger said.
    blocked_until: Option<Instant>,
    /// When the ledger's listing of the account that these holds come from was stored
    /// ([`LocalView::replace`]): a hold answered by then is in it already.
    listed_at: Option<Instant>,
    /// That listing missed holds (more than a listing reads: the oldest ones).
    listed_incomplete: bool,
    /// When the ledger last said this caller has no room: its listing was stored
    /// ([`LISTING_TRUSTED_FOR`]).
    confirmed_at: Option<Instant>,
    /// When a probe of this caller (its listing asked for again) was sent, until a listing is
    /// stored.
    probing_since: Option<Instant>,
}

/// Room for holds a caller's buffer keeps however few it holds: below it, shrinking would cost
/// more than the memory it frees.
const HOLDS_ROOM_KEPT: usize = 16;

impl CallerHolds {
    /// `Some` when `cost` does not fit in the credit this caller is known to have free (a
    /// verified caller: its credit and block are the ledger's word), until when.
    fn limit(&mut self, cost: u64, now: Instant) -> Option<LocalLimit> {
        if let Some(until) = self.blocked_until.filter(|until| *until > now) {
            // Read over a minute ago: the ledger decides again (and lists the account anew), not
            // the credit check below, which would refuse a blocked caller as rate limited.
            let block_read = self
                .listed_at
                .is_some_and(|at| now < at + BLOCK_TRUSTED_FOR);
            return block_read.then(|| self.block_limit(until, now));
        }
        if self.available() >= cost {
            return None;
        }
        let retry_after = self.fits_at(cost, now).saturating_duration_since(now);
        // A refusal's `t` is never before its `Retry-After` (as the ledger's refusal says too):
        // more may be back sooner, but not enough for this request.
        let quota = self.quota(now);
        let quota = LocalQuota {
            reset_after: quota.reset_after.max(retry_after),
            ..quota
        };
        Some(LocalLimit {
            retry_after,
            quota,
            blocked: false,
        })
    }

    /// The refusal of a caller blocked until `until`.
    fn block_limit(&self, until: Instant, now: Instant) -> LocalLimit {
        let retry_after = until - now;
        // Nothing to spend until the block ends, which is also when the quota is back.
        let quota = LocalQuota {
            remaining: 0,
            reset_after: self.quota(now).reset_after.max(retry_after),
        };
        LocalLimit {
            retry_after,
            quota,
            blocked: true,
        }
    }

    fn new(credit: u64) -> Self {
        CallerHolds {
            credit,
            holds: VecDeque::new(),
            held: 0,
            latest_expiry: None,
            verified: false,
            blocked_until: None,
            listed_at: None,
            listed_incomplete: false,
            confirmed_at: None,
            probing_since: None,
        }
    }

    /// A refusal from memory (`limit`, for want of credit or a block) as
    /// [`LocalView::check_trusted`] answers it: a block, or a word the ledger gave less than
    /// [`LISTING_TRUSTED_FOR`] ago, refuses; an older word refuses while a probe is out, else
    /// this request probes (`take_probe`) or asks the ledger.
    fn trusted(
        &mut self,
        limit: LocalLimit,
        (now, pending): (Instant, Duration),
        take_probe: bool,
    ) -> Check {
        let fresh = |at: Option<Instant>, within: Duration| at.is_some_and(|at| now < at + within);
        if limit.blocked || fresh(self.confirmed_at, LISTING_TRUSTED_FOR) {
            return Check::Refuse(limit);
        }
        if fresh(self.probing_since, pending) {
            return Check::Refuse(limit);
        }
        if !take_probe {
            return Check::Ask;
        }
        self.probing_since = Some(now);
        Check::Probe(limit)
    }

    /// Until when this caller has something live to remember (a hold, or a block); `None` when
    /// nothing (pruned first).
    fn live_until(&self, now: Instant) -> Option<Instant> {
        let held = self.latest_expiry.filter(|_| !self.holds.is_empty());
        let blocked = self.blocked_until.filter(|until| *until > now);
        held.max(blocked)
    }

    fn prune(&mut self, now: Instant) {
        // The holds are in expiry order ([`CallerHolds::push`]): what expired is at the front.
        while let Some(front) = self.holds.front() {
            if front.expires_at > now {
                break;
            }
            self.held -= front.amount;
            self.holds.pop_front();
        }
        if self.holds.is_empty() {
            self.latest_expiry = None;
        }
        // A burst's room goes back once its holds expire: kept, a caller that spent a plan of
        // hundreds once held it for as long as it was remembered (24 bytes a hold).
        if self.holds.capacity() > HOLDS_ROOM_KEPT && self.holds.len() * 4 < self.holds.capacity() {
            self.holds.shrink_to(self.holds.len() * 2);
        }
    }

    fn push(&mut self, hold: LocalHold) {
        if self.holds.len() == HOLDS_PER_CALLER_MAX {
            let a = self.holds.pop_front().expect("full");
            let b = self.holds.front_mut().expect("full");
            b.amount += a.amount;
            // The earlier of the two: b's units are then forgotten early (the safe side). The
            // later one kept the merged units past their expiry, and every merge after it moved
            // that expiry on: a busy caller's oldest units were held for as long as it was busy.
            let lowered = a.expires_at < b.expires_at;
            let was_latest = Some(b.expires_at) == self.latest_expiry;
            b.expires_at = b.expires_at.min(a.expires_at);
            if lowered && was_latest {
                self.latest_expiry = self.holds.iter().map(|h| h.expires_at).max();
            }
        }
        self.held += hold.amount;
        self.latest_expiry = Some(
            self.latest_expiry
                .map_or(hold.expires_at, |latest| latest.max(hold.expires_at)),
        );
        // In expiry order, nearly always at the back. Why: a lease (window + L) is recorded
        // before the requests' holds (a window) that expire ahead of it; appended behind it, they
        // outlived their expiry here, and were refused on from memory while the ledger had them
        // back, for up to L.
        let at = match self.holds.back() {
            Some(last) if last.expires_at > hold.expires_at => self
                .holds
                .partition_point(|h| h.expires_at <= hold.expires_at),
            _ => self.holds.len(),
        };
        self.holds.insert(at, hold);
        debug_assert_eq!(self.held, self.holds.iter().map(|h| h.amount).sum::<u64>());
    }

    fn available(&self) -> u64 {
        self.credit.saturating_sub(self.held)
    }

    /// When `cost` will fit, assuming nobody else takes credit meanwhile. A cost above the whole
    /// credit never fits: when the quota is whole again, and a second from now at the earliest,
    /// so that its Retry-After never says "now" (an Envoy call's hits above its limit).
    fn fits_at(&self, cost: u64, now: Instant) -> Instant {
        let mut available = self.available();
        let mut at = now;
        let mut release_at = now;
        for hold in &self.holds {
            if available >= cost {
                break;
            }
            release_at = release_at.max(hold.expires_at);
            available += hold.amount;
            at = release_at;
        }
        if available < cost {
            return at.max(now + NEVER_FITS_RETRY_MIN);
        }
        at
    }

    fn quota(&self, now: Instant) -> LocalQuota {
        debug_assert_eq!(
            self.latest_expiry,
            self.holds.iter().map(|h| h.expires_at).max()
        );
        // The first hold (in expiry order) that holds something: its release makes more of the
        // quota available, which is what draft -10's `t` says. Not the last: `t` said when the
        // quota is whole again, later than more is back whenever holds are spread over the
        // window (a 429's `t` then said a later time than its `Retry-After`).
        let more_at = self.holds.iter().find(|hold| hold.amount > 0);
        let more_at = more_at.map_or(now, |hold| hold.expires_at);
        LocalQuota {
            remaining: self.available(),
            reset_after: more_at.saturating_duration_since(now),
        }
    }
}

/// A hold to recharge: its amount and the expiry this instance recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalRecharge {
    pub amount: u64,
    pub expires_at: Instant,
}

/// The quota as this instance sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalQuota {
    pub remaining: u64,
    /// Until more of the quota is back: the first known hold's release (zero when none is).
    pub reset_after: Duration,
}

/// What the view says of a request ([`LocalView::check_trusted`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// Nothing that refuses it: the ledger decides.
    Ask,
    /// Refused from memory.
    Refuse(LocalLimit),
    /// Refused from memory on a word of the ledger's older than [`LISTING_TRUSTED_FOR`], unless
    /// the caller's account, listed again, has room now: this request lists it.
    Probe(LocalLimit),
}

/// A caller this instance knows to be exhausted for a cost, or blocked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalLimit {
    /// When the cost will fit again (waiting this long then succeeds, unless others spend first).
    pub retry_after: Duration,
    pub quota: LocalQuota,
    /// An operator's block, not the caller's spending, refuses it.
    pub blocked: bool,
}

/// How many times an account's shard of the view was told of a change the ledger's listing of
/// the account may predate (a clear, a forget, a release, a recharge): read before a listing is
/// asked for ([`LocalView::generation`]) and given back with it ([`Listing`]). Why: a listing
/// read before an operator acted, and stored after the view forgot what that action changed,
/// said what the action had undone: an unblocked caller was refused from memory until its old
/// block's end (up to a week). Per shard, so that the forgets of routine traffic (Envoy's
/// releases) keep few listings from being stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Generation(u64);

/// What the ledger said of an account, and the generation of its shard when it was asked.
#[derive(Debug, Clone, Copy)]
pub struct Listing<'a> {
    pub view: &'a AccountView,
    pub read: Generation,
}

pub struct LocalView {
    shards: Box<[Mutex<HashMap<u128, CallerHolds>>]>,
    /// One [`Generation`] per shard, counted up under the shard's lock by each change a listing
    /// may predate, and read under it by `replace`: a listing stored before the count went up
    /// is then changed by what counted it (a forget removes it, a release of a listed hold too).
    generations: Box<[AtomicU64]>,
    /// Which callers may be verified, a bit each ([`VERIFIED_FILTER_BITS`]): set before a
    /// verified caller is stored, under its shard's lock. A clear bit means none is stored, but
    /// for one stored while the view was being cleared ([`LocalView::clear`] says why that is
    /// safe).
    verified_filter: Box<[AtomicU64]>,
    callers_per_shard_max: usize,
    /// Per shard, locked under the shard's lock: when a full shard that its last sweep could not
    /// thin has something to forget (its first entry to end). Until then a caller that finds no
    /// room is not remembered, without a sweep: each miss swept the whole shard, under its
    /// lock, while nothing could go.
    sweep_not_before: Box<[Mutex<Option<Instant>>]>,
    /// Added to every expiry: TigerBeetle releases a hold up to ~100 ms after it is due.
    expiry_margin: Duration,
    /// Blocks read before a clear, until they end or the caller is heard of again: read by
    /// [`LocalView::known_block`] alone, the failure policy's answer. Why: a clear follows any
    /// operator act anywhere, and it dropped every block read, so a ledger outage after a
    /// top-up of anyone admitted blocked callers under fail-open. At most [`BLOCKS_KEPT_MAX`].
    blocks_kept: Mutex<HashMap<u128, KeptBlock>>,
    /// How many `blocks_kept` holds: a caller's hold recorded looks there only when some are.
    blocks_kept_count: AtomicUsize,
    /// How long a probe stands pending ([`PROBE_PENDING_MAX`], or the ledger's deadline).
    probe_pending: Duration,
}

impl LocalView {
    /// `callers_max` 0 turns the view off: nothing is remembered, every request asks the ledger
    /// (for limits whose holds end early, such as concurrency slots voided by other instances).
    pub fn new(callers_max: usize, expiry_margin: Duration) -> Self {
        let shards = (0..SHARD_COUNT)
            .map(|_| Mutex::new(HashMap::new()))
            .collect::<Vec<_>>()
            .into_boxed_slice();
        LocalView {
            shards,
            verified_filter: (0..VERIFIED_FILTER_WORDS)
                .map(|_| AtomicU64::new(0))
                .collect(),
            generations: (0..SHARD_COUNT).map(|_| AtomicU64::new(0)).collect(),
            callers_per_shard_max: callers_max.div_ceil(SHARD_COUNT),
            sweep_not_before: (0..SHARD_COUNT).map(|_| Mutex::new(None)).collect(),
            expiry_margin,
            blocks_kept: Mutex::new(HashMap::new()),
            blocks_kept_count: AtomicUsize::new(0),
            probe_pending: PROBE_PENDING_MAX,
        }
    }

    /// A probe stands pending up to `deadline` (the ledger's, for its listing), if over a
    /// second.
    pub fn with_probe_pending(mut self, deadline: Duration) -> Self {
        self.probe_pending = deadline.max(PROBE_PENDING_MAX);
        self
    }

    /// Read before asking the ledger for a listing of `account_id`: [`LocalView::replace`]
    /// stores the listing only if nothing the listing may predate happened in its shard since.
    pub fn generation(&self, account_id: u128) -> Generation {
        let index = Self::shard_index(account_id);
        Generation(self.generations[index].load(Ordering::SeqCst))
    }

    /// Counts a change a listing of `account_id` may predate; called under its shard's lock.
    fn changed(&self, account_id: u128) {
        let index = Self::shard_index(account_id);
        self.generations[index].fetch_add(1, Ordering::SeqCst);
    }

    fn shard_index(account_id: u128) -> usize {
        // Account ids are uniformly distributed hashes: the low bits pick a shard well.
        (account_id as usize) % SHARD_COUNT
    }

    fn shard(&self, account_id: u128) -> std::sync::MutexGuard<'_, HashMap<u128, CallerHolds>> {
        lock(&self.shards[Self::shard_index(account_id)])
    }

    /// The filter's word and bit for a caller: bits above the shard's (ids are uniform hashes).
    fn verified_bit(&self, account_id: u128) -> (&AtomicU64, u64) {
        let bit = (account_id >> SHARD_COUNT.trailing_zeros()) as usize % VERIFIED_FILTER_BITS;
        (&self.verified_filter[bit / 64], 1 << (bit % 64))
    }

    /// `Some` when `cost` surely exceeds the caller's available credit right now.
    pub fn check(&self, account_id: u128, cost: u64, now: Instant) -> Option<LocalLimit> {
        self.verified(account_id, now, |holds| holds.limit(cost, now))
    }

    /// [`LocalView::check`], trusting the ledger's word that the caller has no room for
    /// [`LISTING_TRUSTED_FOR`] only ([`Check`]); past it, one request at a time lists the
    /// caller again (`take_probe`; without it, such a request asks the ledger).
    pub fn check_trusted(
        &self,
        account_id: u128,
        cost: u64,
        now: Instant,
        take_probe: bool,
    ) -> Check {
        let checked = self.verified(account_id, now, |holds| {
            let limit = holds.limit(cost, now)?;
            Some(holds.trusted(limit, (now, self.probe_pending), take_probe))
        });
        checked.unwrap_or(Check::Ask)
    }

    /// `what` of a caller the ledger listed (pruned first); `None` for a caller it did not.
    fn verified<R>(
        &self,
        account_id: u128,
        now: Instant,
        what: impl FnOnce(&mut CallerHolds) -> Option<R>,
    ) -> Option<R> {
        // Relaxed is enough: a bit read clear while another thread sets it sends this request to
        // the ledger, as if it had come a moment earlier.
        let (word, bit) = self.verified_bit(account_id);
        if word.load(Ordering::Relaxed) & bit == 0 {
            return None;
        }
        let mut shard = self.shard(account_id);
        let holds = shard.get_mut(&account_id)?;
        holds.prune(now);
        if !holds.verified {
            return None;
        }
        what(holds)
    }

    /// The block this instance last read of `account_id`, while it lasts, trusted or not
    /// (a minute): the answer when the ledger cannot be asked, so that a failure
    /// policy never admits a caller an operator blocked.
    /// A block read before a clear answers while the view has heard nothing newer of the caller.
    pub fn known_block(&self, account_id: u128, now: Instant) -> Option<LocalLimit> {
        {
            let mut shard = self.shard(account_id);
            // A listing's word; an entry of holds recorded alone says nothing of a block.
            let listed = shard.get_mut(&account_id).filter(|h| h.listed_at.is_some());
            if let Some(holds) = listed {
                holds.prune(now);
                let until = holds.blocked_until.filter(|until| *until > now)?;
                // Read over a minute ago, perhaps lifted since: come back within a minute.
                let trusted = holds
                    .listed_at
                    .is_some_and(|at| now < at + BLOCK_TRUSTED_FOR);
                let told_until = match trusted {
                    true => until,
                    false => until.min(now + BLOCK_TRUSTED_FOR),
                };
                return Some(holds.block_limit(told_until, now));
            }
        }
        if self.blocks_kept_count.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let mut kept = lock(&self.blocks_kept);
        let until = kept.get(&account_id)?.until;
        if until <= now {
            kept.remove(&account_id);
            self.blocks_kept_count.store(kept.len(), Ordering::Relaxed);
            return None;
        }
        // The act behind the clear may have been its unblock: told to come back within a
        // minute, not at the block's end (a week), the ledger then asked again.
        let mut holds = CallerHolds::new(0);
        let told_until = until.min(now + BLOCK_TRUSTED_FOR);
        holds.blocked_until = Some(told_until);
        Some(holds.block_limit(told_until, now))
    }

    /// Drops a kept block if the caller was heard of (`at`: a listing that read it unblocked, a
    /// hold the ledger admitted) after the block was learned: newer word.
    fn heard_of(&self, account_id: u128, at: Instant) {
        if self.blocks_kept_count.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut kept = lock(&self.blocks_kept);
        if kept.get(&account_id).is_some_and(|k| k.learned_at < at) {
            kept.remove(&account_id);
        }
        self.blocks_kept_count.store(kept.len(), Ordering::Relaxed);
    }

    /// Keeps `block` for the failure policy (never under a shard's lock: `clear` takes them
    /// after `blocks_kept`).
    fn keep(&self, account_id: u128, block: KeptBlock, now: Instant) {
        let mut kept = lock(&self.blocks_kept);
        if kept.len() >= BLOCKS_KEPT_MAX {
            // Full: what ended goes first (else ended blocks kept live ones out until a clear).
            kept.retain(|_, k| k.until > now);
        }
        if kept.len() < BLOCKS_KEPT_MAX || kept.contains_key(&account_id) {
            kept.insert(account_id, block);
        }
        self.blocks_kept_count.store(kept.len(), Ordering::Relaxed);
    }

    /// Keeps the live block, if any, of a caller's entry taken out of its shard (after its
    /// lock is let go).
    fn keep_block_of(&self, account_id: u128, removed: Option<CallerHolds>, now: Instant) {
        let Some(holds) = removed else { return };
        let Some(until) = holds.blocked_until.filter(|until| *until > now) else {
            return;
        };
        let learned_at = holds.listed_at.unwrap_or(now);
        self.keep(account_id, KeptBlock { until, learned_at }, now);
    }

    /// Keeps the blocks of `shard`, about to be cleared, in `kept` while they last.
    fn keep_blocks(
        kept: &mut HashMap<u128, KeptBlock>,
        shard: &HashMap<u128, CallerHolds>,
        now: Instant,
    ) {
        for (account_id, holds) in shard {
            let Some(until) = holds.blocked_until.filter(|until| *until > now) else {
                // Listed unblocked since its block was kept: newer.
                let newer = |k: &KeptBlock| holds.listed_at.is_some_and(|at| at > k.learned_at);
                if kept.get(account_id).is_some_and(newer) {
                    kept.remove(account_id);
                }
                continue;
            };
            if kept.len() < BLOCKS_KEPT_MAX || kept.contains_key(account_id) {
                let learned_at = holds.listed_at.unwrap_or(now);
                kept.insert(*account_id, KeptBlock { until, learned_at });
            }
        }
    }

    /// Forgets a caller: an operator changed its credit or block here, or its holds changed in ways
    /// this instance cannot follow (voided by amount). Its next request asks the ledger.
    /// A block it had read is kept for the failure policy.
    pub fn forget(&self, account_id: u128) {
        let removed = {
            let mut shard = self.shard(account_id);
            // A listing read before the removal is not stored after it.
            self.changed(account_id);
            shard.remove(&account_id)
        };
        self.keep_block_of(account_id, removed, Instant::now());
    }

    /// [`LocalView::forget`] for an operator's act on the caller here. What it did to a block
    /// decides what the failure policy keeps: none once lifted; the new one, until its end; the
    /// one read, if any, when the act proved nothing (a retry). (Other
    /// forgets, of holds this instance cannot follow, keep a kept block too.)
    pub fn forget_acted_on(&self, account_id: u128, act: BlockAct, now: Instant) {
        let removed = {
            let mut shard = self.shard(account_id);
            self.changed(account_id);
            shard.remove(&account_id)
        };
        match act {
            BlockAct::Lifted => {
                let mut kept = lock(&self.blocks_kept);
                kept.remove(&account_id);
                self.blocks_kept_count.store(kept.len(), Ordering::Relaxed);
            }
            BlockAct::Blocked(until) => {
                let learned_at = now;
                self.keep(account_id, KeptBlock { until, learned_at }, now);
            }
            BlockAct::Unchanged => self.keep_block_of(account_id, removed, now),
        }
    }

    /// Forgets every caller (an operator acted somewhere: any credit or block may have changed),
    /// but for the blocks it read, which only the failure policy reads from now on.
    pub fn clear(&self, now: Instant) {
        let mut kept = lock(&self.blocks_kept);
        // While the shards are cleared, a caller heard of waits for the lock, whatever is kept:
        // skipped, its block kept below would outlive what was heard.
        self.blocks_kept_count.store(usize::MAX, Ordering::Relaxed);
        kept.retain(|_, kept| kept.until > now);
        for (shard, generation) in self.shards.iter().zip(self.generations.iter()) {
            let mut shard = lock(shard);
            // A listing read before the clear is not stored after it.
            generation.fetch_add(1, Ordering::SeqCst);
            Self::keep_blocks(&mut kept, &shard, now);
            shard.clear();
        }
        self.blocks_kept_count.store(kept.len(), Ordering::Relaxed);
        drop(kept);
        // After the shards: a caller verified meanwhile may lose its bit; the ledger then refuses
        // it, as it refuses a caller the view does not know, and that refusal sets the bit again.
        for word in self.verified_filter.iter() {
            word.store(0, Ordering::Relaxed);
        }
    }

    /// Records a hold the ledger accepted; returns the caller's quota after it.
    ///
    /// A hold sent before the caller's holds were last replaced by a listing
    /// ([`LocalView::replace`], stored after the listing's answer) is not recorded again: the
    /// ledger answers one client's calls in the order they went, so a hold sent before the
    /// listing was is in it ([`Roundtrip`]). Recording it twice counted it twice for a window,
    /// and the view refused the caller while the ledger had credit for it: a caller at its
    /// limit, whose refusals read the account while its admissions were being recorded, was
    /// admitted less than its limit. (A hold sent after the listing went but before it was
    /// stored is then not counted: the view counts too little, which only sends a request to
    /// the ledger.) The hold expires by `roundtrip.answered_at + timeout`.
    pub fn record_hold(
        &self,
        account_id: u128,
        credit: u64,
        amount: u64,
        roundtrip: Roundtrip,
        timeout: Duration,
        now: Instant,
    ) -> LocalQuota {
        let hold = LocalHold {
            amount,
            expires_at: roundtrip.answered_at + timeout + self.expiry_margin,
        };
        let sent_at = roundtrip.sent_at;
        let quota = self.record_hold_in_shard(account_id, credit, hold, (sent_at, now), true);
        // After the shard: a clear between the two then finds the caller unblocked there. The
        // send, not the answer: only a hold sent after a block was read proves it lifted since.
        self.heard_of(account_id, sent_at);
        quota
    }

    /// [`LocalView::record_hold`] of a lease's settlement whose answer may not have come (its
    /// outcome unknown): no word that the account is open, so no block read is dropped for it.
    pub fn record_settled_hold(
        &self,
        account_id: u128,
        credit: u64,
        amount: u64,
        timeout: Duration,
        now: Instant,
    ) {
        let hold = LocalHold {
            amount,
            expires_at: now + timeout + self.expiry_margin,
        };
        self.record_hold_in_shard(account_id, credit, hold, (now, now), false);
    }

    /// `proves_open`: the ledger admitted the hold, so the caller's account was open then.
    fn record_hold_in_shard(
        &self,
        account_id: u128,
        credit: u64,
        hold: LocalHold,
        (sent_at, now): (Instant, Instant),
        proves_open: bool,
    ) -> LocalQuota {
        let mut shard = self.shard(account_id);
        let holds = match shard.entry(account_id) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(_) => {
                if !self.has_room(&mut shard, account_id, now) {
                    // Full of active callers: skip remembering this one. The ledger stays exact;
                    // only the headers are less precise for it.
                    let mut alone = CallerHolds::new(credit);
                    alone.push(hold);
                    return alone.quota(now);
                }
                shard
                    .entry(account_id)
                    .or_insert_with(|| CallerHolds::new(credit))
            }
        };
        holds.prune(now);
        let listed = holds.listed_at.is_some_and(|at| sent_at <= at);
        if !listed {
            holds.push(hold);
            // Admitted after the block was read: lifted since (kept, a later clear would keep
            // it, and an outage refuse the caller on a stale word).
            if proves_open {
                holds.blocked_until = None;
            }
        }
        holds.quota(now)
    }

    /// Forgets one hold this instance recorded (it was voided). A hold that came from the
    /// ledger's listing has the ledger's expiry, not the one recorded here, and cannot be told
    /// apart: then the caller is forgotten, so that the voided units are not counted as held
    /// for the rest of their window (its next refusal reads the account again). If the hold is
    /// no longer known otherwise (merged with others, or pruned), nothing changes.
    pub fn release(&self, account_id: u128, amount: u64, expires_at: Instant) {
        self.release_found(account_id, amount, expires_at);
    }

    /// [`LocalView::release`]: whether the view had the hold, told apart from the others.
    fn release_found(&self, account_id: u128, amount: u64, expires_at: Instant) -> bool {
        let mut shard = self.shard(account_id);
        // A listing read before the void lists the hold still.
        self.changed(account_id);
        let Some(holds) = shard.get_mut(&account_id) else {
            return false;
        };
        let found = holds
            .holds
            .iter()
            .rposition(|h| h.amount == amount && h.expires_at == expires_at);
        match found {
            Some(index) => {
                holds.holds.remove(index);
                holds.held -= amount;
                holds.latest_expiry = holds.holds.iter().map(|h| h.expires_at).max();
                return true;
            }
            None if holds.listed_at.is_some() => {
                let removed = shard.remove(&account_id);
                drop(shard);
                self.keep_block_of(account_id, removed, Instant::now());
            }
            None => {}
        }
        false
    }

    /// Replaces one hold this instance recorded by one of `actual` units with the same expiry (a
    /// cost known after the response). The ledger voids the old hold and holds as much of
    /// `actual` as is then free; the view records as much as it thinks free, which is exact on
    /// one instance (and keeps the `RateLimit` fields right). Above the old hold's units it may
    /// be more than the ledger took (other instances' holds, unknown here, leave less free), so
    /// the caller is no longer the ledger's word: it is not refused from memory until a listing
    /// says again (a refusal from memory of what the ledger admits would break the rule).
    pub fn recharge(&self, account_id: u128, old: LocalRecharge, actual: u64, now: Instant) {
        let found = self.release_found(account_id, old.amount, old.expires_at);
        let mut shard = self.shard(account_id);
        if !found {
            // Not a hold this view can tell apart (merged with others at the bound of holds
            // per caller, or never recorded): the new one beside it would count it twice.
            let removed = shard.remove(&account_id);
            drop(shard);
            self.keep_block_of(account_id, removed, now);
            return;
        }
        let Some(holds) = shard.get_mut(&account_id) else {
            return;
        };
        holds.prune(now);
        if actual > old.amount {
            holds.verified = false;
        }
        let amount = actual.min(holds.available());
        if amount > 0 && old.expires_at > now {
            holds.push(LocalHold {
                amount,
                expires_at: old.expires_at,
            });
        }
    }

    /// Replaces what this instance knows of a caller by what the ledger just said: `Some` when
    /// `cost` does not fit in what the listing says is free, until when (the answer to the
    /// request the ledger refused). The listing is not stored if something it may predate
    /// happened in its shard since it was asked for ([`Generation`]); its answer stands all the
    /// same (the ledger's word at the time). `None` with the view off.
    pub fn replace(
        &self,
        account_id: u128,
        listing: Listing<'_>,
        cost: u64,
        window_max: Duration,
        now: Instant,
        now_wall: SystemTime,
    ) -> Option<LocalLimit> {
        if self.callers_per_shard_max == 0 {
            return None;
        }
        let Listing { view, read } = listing;
        let mut holds = CallerHolds::new(view.credit);
        holds.verified = true;
        holds.listed_at = Some(now);
        holds.confirmed_at = Some(now);
        holds.listed_incomplete = !view.complete;
        // A moved caller's old account is closed for good, but the caller is not refused: the
        // limiter follows the move instead.
        let blocks = view.blocked.filter(|closed| closed.moved_to.is_none());
        holds.blocked_until = blocks.map(|blocked| match blocked.until {
            Some(until) => {
                let remaining = until.duration_since(now_wall).unwrap_or(Duration::ZERO);
                now + remaining + self.expiry_margin
            }
            // A block whose end could not be read: refuse for a window, then ask again.
            None => now + window_max,
        });
        for hold in &view.holds {
            let remaining = hold
                .expires_at
                .duration_since(now_wall)
                .unwrap_or(Duration::ZERO);
            holds.push(LocalHold {
                amount: hold.amount,
                expires_at: now + remaining + self.expiry_margin,
            });
        }
        // Holds the ledger counts but could not be listed (`!view.complete`) are the oldest ones
        // (listed newest first): they may expire any moment, so they count as not held. Assuming
        // they lasted a whole window refused callers for up to the longest plan's window after
        // the ledger would admit them (an Envoy rule of a second under an hour-long plan).
        let limit = holds.limit(cost, now);
        let blocked_until = holds.blocked_until;
        let stored = self.store_listed(account_id, holds, read, now);
        match (stored, blocked_until) {
            // Read unblocked, and not stale: a block kept past a clear is over.
            (Stored::Yes | Stored::NoRoom, None) => self.heard_of(account_id, now),
            // A block read and not stored is kept for the failure policy all the same; stale (a
            // change in its shard since it was asked for, an unblock here perhaps), for a minute
            // at most.
            (Stored::NoRoom | Stored::Stale, Some(until)) => {
                let until = match stored {
                    Stored::Stale => until.min(now + BLOCK_TRUSTED_FOR),
                    _ => until,
                };
                let learned_at = now;
                self.keep(account_id, KeptBlock { until, learned_at }, now);
            }
            // Stale, with room: the entry it could not replace is older still, and counts what
            // the ledger no longer holds. Kept, with this listing's probe fresh, it refused the
            // caller from memory for as long as a probe stands pending (the ledger's deadline,
            // and again at each stale probe, likely in a busy shard) while the ledger had room.
            (Stored::Stale, None) if limit.is_none() => self.forget_older(account_id, now),
            (Stored::Yes, Some(_)) | (Stored::Stale, None) => {}
        }
        limit
    }

    /// Takes out `account_id`'s entry, older than a listing with room that came back stale
    /// (its block, if any, kept for the failure policy): the ledger decides its next request.
    fn forget_older(&self, account_id: u128, now: Instant) {
        let removed = self.shard(account_id).remove(&account_id);
        self.keep_block_of(account_id, removed, now);
    }

    /// Stores a listing's `holds` unless something it may predate happened in its shard since
    /// it was asked for (`read`), or the shard is full of active callers (the ledger's next
    /// refusal lists the account again).
    fn store_listed(
        &self,
        account_id: u128,
        holds: CallerHolds,
        read: Generation,
        now: Instant,
    ) -> Stored {
        let mut shard = self.shard(account_id);
        if self.generation(account_id) != read {
            return Stored::Stale;
        }
        if !shard.contains_key(&account_id) && !self.has_room(&mut shard, account_id, now) {
            return Stored::NoRoom;
        }
        let (word, bit) = self.verified_bit(account_id);
        word.fetch_or(bit, Ordering::Relaxed);
        if holds.blocked_until.is_some() {
            // An older listing, read open before this one, comes back stale: it must not
            // overwrite the block.
            self.changed(account_id);
        }
        shard.insert(account_id, holds);
        Stored::Yes
    }

    /// Whether `shard` (`account_id`'s) has room for one more caller, once callers with nothing
    /// live are forgotten: no hold, and no block. A block is kept while it lasts: a blocked
    /// caller places no holds, so it went first, and then a ledger failure under the open
    /// policy admitted it ([`LocalView::known_block`] is what refuses it then).
    fn has_room(
        &self,
        shard: &mut HashMap<u128, CallerHolds>,
        account_id: u128,
        now: Instant,
    ) -> bool {
        let mut not_before = lock(&self.sweep_not_before[Self::shard_index(account_id)]);
        if shard.len() < self.callers_per_shard_max {
            // Thinned since (a forget, a clear): what the last sweep found is stale.
            *not_before = None;
            return true;
        }
        if not_before.is_some_and(|at| now < at) {
            return false;
        }
        let mut first_end: Option<Instant> = None;
        shard.retain(|_, h| {
            h.prune(now);
            let end = h.live_until(now);
            if let Some(end) = end {
                first_end = Some(first_end.map_or(end, |first| first.min(end)));
            }
            end.is_some()
        });
        let room = shard.len() < self.callers_per_shard_max;
        *not_before = if room { None } else { first_end };
        room
    }

    /// The quota this instance knows for a caller (`credit` if it knows nothing).
    pub fn quota(&self, account_id: u128, credit: u64, now: Instant) -> LocalQuota {
        let mut shard = self.shard(account_id);
        match shard.get_mut(&account_id) {
            Some(holds) => {
                holds.prune(now);
                holds.quota(now)
            }
            None => LocalQuota {
                remaining: credit,
                reset_after: Duration::ZERO,
            },
        }
    }

    /// The credit a caller has free right now, when the ledger has verified what this view
    /// knows of it (`None`: a guess, or not known), and whether its last listing missed holds
    /// (then the free credit counts them as free: an upper bound, not the ledger's word).
    pub fn verified_free(&self, account_id: u128, now: Instant) -> Option<(u64, bool)> {
        let mut shard = self.shard(account_id);
        let holds = shard.get_mut(&account_id)?;
        holds.prune(now);
        holds
            .verified
            .then(|| (holds.available(), holds.listed_incomplete))
    }

    /// The quota of a caller whose last listing, stored after `since`, missed holds (it has
    /// more than a listing reads); `None` otherwise. Why: listing it again within a moment costs
    /// up to [`crate::ledger::TRANSFERS_PAGES_MAX`] more calls and says no more.
    pub fn listed_incomplete_since(
        &self,
        account_id: u128,
        since: Instant,
        now: Instant,
    ) -> Option<LocalQuota> {
        let mut shard = self.shard(account_id);
        let holds = shard.get_mut(&account_id)?;
        let lately = holds.listed_at.is_some_and(|at| at >= since);
        if !(holds.listed_incomplete && lately) {
            return None;
        }
        holds.prune(now);
        Some(holds.quota(now))
    }

    /// How long until `cost` would fit in a verified caller's credit were `amount` more held now
    /// for `timeout` (not recorded; zero if it fits now): `None` if the caller is not known
    /// verified. A block is not asked about: the caller of a hold just placed is not blocked.
    pub fn fits_after_hold(
        &self,
        account_id: u128,
        cost: u64,
        (amount, timeout): (u64, Duration),
        now: Instant,
    ) -> Option<Duration> {
        let mut holds = {
            let mut shard = self.shard(account_id);
            let holds = shard.get_mut(&account_id)?;
            holds.prune(now);
            if !holds.verified {
                return None;
            }
            holds.clone()
        };
        holds.push(LocalHold {
            amount,
            expires_at: now + timeout + self.expiry_margin,
        });
        Some(holds.fits_at(cost, now).saturating_duration_since(now))
    }

    /// Whether this instance remembers anything of the caller (else its quota is a guess).
    pub fn knows(&self, account_id: u128) -> bool {
        self.shard(account_id).contains_key(&account_id)
    }

    /// Whether this view would keep what the ledger says of `account_id` now: it is on, and
    /// knows the caller or has room for it, once callers with nothing live are forgotten (as
    /// [`LocalView::replace`] would make room). A listing it would not keep is paid again on every
    /// refused request.
    pub fn can_keep(&self, account_id: u128, now: Instant) -> bool {
        if self.callers_per_shard_max == 0 {
            return false;
        }
        let mut shard = self.shard(account_id);
        shard.contains_key(&account_id) || self.has_room(&mut shard, account_id, now)
    }

    /// Whether this view could take in what the ledger says of `account_id` now: it is on, and
    /// knows the caller or has room for it (without forgetting anyone to make room). Reading an
    /// account the view cannot keep would be paid again on every request.
    pub fn has_room_for(&self, account_id: u128) -> bool {
        if self.callers_per_shard_max == 0 {
            return false;
        }
        let shard = self.shard(account_id);
        shard.len() < self.callers_per_shard_max || shard.contains_key(&account_id)
    }

    pub fn callers(&self) -> usize {
        self.shards.iter().map(|s| lock(s).len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::Hold;
    use proptest::prelude::*;

    const MARGIN: Duration = Duration::from_millis(250);
    const WINDOW: Duration = Duration::from_secs(30);

    fn ledger_view(credit: u64, expiries: &[Duration], wall: SystemTime) -> AccountView {
        let holds: Vec<Hold> = expiries
            .iter()
            .enumerate()
            .map(|(id, e)| Hold {
                id: id as u128,
                amount: 1,
                expires_at: wall + *e,
                leased_at: None,
            })
            .collect();
        AccountView {
            credit,
            granted: credit > 0,
            available: credit.saturating_sub(holds.len() as u64),
            holds,
            complete: true,
            blocked: None,
        }
    }

    /// A caller of credit 5, nothing held, blocked until `until` (`None`: an end not read).
    fn blocked_view(until: Option<SystemTime>, wall: SystemTime) -> AccountView {
        AccountView {
            blocked: Some(crate::ledger::Blocked {
                until,
                moved_to: None,
            }),
            ..ledger_view(5, &[], wall)
        }
    }

    /// Stores `account` as a listing of caller `id` asked for just now (nothing cleared since).
    fn list(view: &LocalView, id: u128, account: &AccountView, now: Instant, wall: SystemTime) {
        let read = view.generation(id);
        view.replace(
            id,
            Listing {
                view: account,
                read,
            },
            0,
            WINDOW,
            now,
            wall,
        );
    }

    /// Caller 7 (credit 5) with one hold recorded at `t0`, then `listed` holds in the ledger's
    /// listing stored at `t0` + 2 ms: the view, `t0` and when the listing was stored.
    fn listed_after_one_recorded(listed: usize) -> (LocalView, Instant, Instant) {
        let view = LocalView::new(100, MARGIN);
        let t0 = Instant::now();
        let wall = SystemTime::now();
        view.record_hold(7, 5, 1, Roundtrip::at(t0), WINDOW, t0);
        let listed_at = t0 + Duration::from_millis(2);
        let holds = vec![WINDOW; listed];
        list(&view, 7, &ledger_view(5, &holds, wall), listed_at, wall);
        (view, t0, listed_at)
    }

    /// Past [`LISTING_TRUSTED_FOR`], one request at a time lists the caller again (the
    /// middleware's fast path leaves it to a decision); a probe unanswered for
    /// [`PROBE_PENDING_MAX`] is taken by another request; a listing still short renews the word.
    #[test]
    fn an_old_listing_is_probed_by_one_request_at_a_time() {
        let (view, _, listed_at) = listed_after_one_recorded(5);
        let refuses = |at: Instant, take: bool| {
            matches!(view.check_trusted(7, 1, at, take), Check::Refuse(_))
        };
        let probes = |at: Instant| matches!(view.check_trusted(7, 1, at, true), Check::Probe(_));
        assert!(
            refuses(listed_at + Duration::from_millis(900), true),
            "a fresh word"
        );
        let old = listed_at + LISTING_TRUSTED_FOR;
        assert_eq!(view.check_trusted(7, 1, old, false), Check::Ask);
        assert!(probes(old));
        assert!(
            refuses(old, true) && refuses(old, false),
            "one probe at a time"
        );
        let unanswered = old + PROBE_PENDING_MAX;
        assert!(probes(unanswered), "another request probes");
        // The probe's listing, still short, is the ledger's word anew.
        let wall = SystemTime::now();
        list(
            &view,
            7,
            &ledger_view(5, &[WINDOW; 5], wall),
            unanswered,
            wall,
        );
        assert!(
            refuses(unanswered + Duration::from_millis(900), true),
            "the word renewed"
        );
        assert!(
            refuses(unanswered + 2 * PROBE_PENDING_MAX, true),
            "not the probe's wait"
        );
        assert!(probes(unanswered + LISTING_TRUSTED_FOR));
        // A caller with room is no probe's: nothing refuses it.
        assert_eq!(view.check_trusted(8, 1, old, true), Check::Ask);
    }

    /// A probe waits for its listing as long as the ledger may take to answer it (its deadline,
    /// when longer than [`PROBE_PENDING_MAX`]): taken sooner by another request, a second
    /// listing went for the same caller.
    #[test]
    fn a_probe_stands_pending_for_the_ledgers_deadline_when_longer() {
        let t0 = Instant::now();
        let wall = SystemTime::now();
        let slow = Duration::from_secs(3);
        let fast = Duration::from_millis(200);
        for (deadline, pending) in [(slow, slow), (fast, PROBE_PENDING_MAX)] {
            let view = LocalView::new(100, MARGIN).with_probe_pending(deadline);
            list(&view, 7, &ledger_view(5, &[WINDOW; 5], wall), t0, wall);
            let probes = |at| matches!(view.check_trusted(7, 1, at, true), Check::Probe(_));
            let old = t0 + LISTING_TRUSTED_FOR;
            assert!(probes(old));
            let just_before = old + pending - Duration::from_millis(1);
            assert!(!probes(just_before), "pending for {pending:?}");
            assert!(probes(old + pending), "taken by another after {pending:?}");
        }
    }

    /// A probe's listing that finds room but comes back stale (a change in its shard while it
    /// was read) cannot replace the old entry: the entry goes, and the ledger decides. Kept,
    /// with the probe it had just taken, it refused the caller from memory for the probe's
    /// pending time while the ledger had room.
    #[test]
    fn a_stale_probe_with_room_leaves_no_refusal_behind() {
        let t0 = Instant::now();
        let wall = SystemTime::now();
        let view = LocalView::new(100, MARGIN);
        list(&view, 7, &ledger_view(5, &[WINDOW; 5], wall), t0, wall);
        let old = t0 + LISTING_TRUSTED_FOR;
        assert!(matches!(
            view.check_trusted(7, 1, old, true),
            Check::Probe(_)
        ));
        // Another instance voided the holds; a change in the shard while the probe read.
        let read = view.generation(7);
        view.forget(7 + SHARD_COUNT as u128);
        let listing = Listing {
            view: &ledger_view(5, &[], wall),
            read,
        };
        let answer = view.replace(7, listing, 1, WINDOW, old, wall);
        assert!(answer.is_none(), "room for one");
        assert_eq!(view.check_trusted(7, 1, old, true), Check::Ask);
        assert!(view.check(7, 1, old).is_none());
        // Stale and still short, the old entry stands (it refuses as the ledger does).
        list(&view, 7, &ledger_view(5, &[WINDOW; 5], wall), old, wall);
        let read = view.generation(7);
        view.forget(7 + SHARD_COUNT as u128);
        let listing = Listing {
            view: &ledger_view(5, &[WINDOW; 5], wall),
            read,
        };
        assert!(view.replace(7, listing, 1, WINDOW, old, wall).is_some());
        assert!(matches!(
            view.check_trusted(7, 1, old, true),
            Check::Refuse(_)
        ));
    }

    #[test]
    fn a_hold_answered_before_the_listing_is_counted_once() {
        // Two of five held, both in the listing; the second was answered at t0 + 1 ms, and its
        // request gets round to recording it only now.
        let (view, t0, listed_at) = listed_after_one_recorded(2);
        let late = t0 + Duration::from_millis(1);
        let quota = view.record_hold(7, 5, 1, Roundtrip::at(late), WINDOW, listed_at);
        assert_eq!(quota.remaining, 3, "counted once, from the listing");
        // One answered after the listing is not in it.
        let after = t0 + Duration::from_millis(3);
        let quota = view.record_hold(7, 5, 1, Roundtrip::at(after), WINDOW, after);
        assert_eq!(quota.remaining, 2);
        assert!(view.check(7, 2, after).is_none(), "2 of 5 are still free");
    }

    /// The batch's task may read the ledger's answer well after it came: a hold sent before the
    /// listing went is in it, though the listing was stored before the hold's answer was read.
    #[test]
    fn a_hold_sent_before_the_listing_is_counted_once_however_late_its_answer_is_read() {
        // Two of five held, both in the listing stored at t0 + 2 ms; the second went at
        // t0 + 1 ms, and its answer was read at t0 + 3 ms.
        let (view, t0, listed_at) = listed_after_one_recorded(2);
        let read_late = Roundtrip {
            sent_at: t0 + Duration::from_millis(1),
            answered_at: listed_at + Duration::from_millis(1),
        };
        let quota = view.record_hold(7, 5, 1, read_late, WINDOW, read_late.answered_at);
        assert_eq!(quota.remaining, 3, "counted once, from the listing");
        // One sent after the listing was stored is not in it, and is held to its answer's
        // instant + the window (+ the margin).
        let after = Roundtrip {
            sent_at: listed_at + Duration::from_millis(1),
            answered_at: listed_at + Duration::from_millis(5),
        };
        let quota = view.record_hold(7, 5, 1, after, WINDOW, after.answered_at);
        assert_eq!(quota.remaining, 2);
        let expired = after.answered_at + WINDOW + MARGIN;
        let before_it = expired - Duration::from_millis(1);
        assert_eq!(
            view.quota(7, 5, before_it).remaining,
            4,
            "the listing's 2 ended"
        );
        assert_eq!(view.quota(7, 5, expired).remaining, 5);
    }

    /// A request's hold recorded after a lease (window + L) that outlives it is still pruned
    /// when it expires: recorded behind the lease, it was counted on until the lease's end, and
    /// a request the ledger would admit was refused from memory.
    #[test]
    fn a_hold_that_expires_before_a_lease_recorded_ahead_of_it_is_pruned() {
        let view = LocalView::new(100, Duration::ZERO);
        let (t0, wall) = (Instant::now(), SystemTime::now());
        list(&view, 7, &ledger_view(10, &[], wall), t0, wall);
        let ms = Duration::from_millis;
        // A lease of 5 for a window of 1 s and L of 10 s, then five holds of 1 for the window.
        view.record_hold(
            7,
            10,
            5,
            Roundtrip::at(t0 + ms(1)),
            Duration::from_secs(11),
            t0 + ms(1),
        );
        for _ in 0..5 {
            view.record_hold(
                7,
                10,
                1,
                Roundtrip::at(t0 + ms(2)),
                Duration::from_secs(1),
                t0 + ms(2),
            );
        }
        assert!(view.check(7, 1, t0 + ms(3)).is_some(), "all 10 held");
        let later = t0 + Duration::from_secs(2);
        assert_eq!(view.check(7, 1, later), None, "the five are back");
        assert_eq!(view.quota(7, 10, later).remaining, 5);
    }

    /// A burst's room goes back once its holds expire: a caller that spent 1,000 units once
    /// kept room for 1,024 holds (24 KiB) for as long as it was remembered.
    #[test]
    fn a_bursts_room_goes_back_once_its_holds_expire() {
        let view = LocalView::new(100, Duration::ZERO);
        let (t0, wall) = (Instant::now(), SystemTime::now());
        list(&view, 7, &ledger_view(5_000, &[], wall), t0, wall);
        let second = Duration::from_secs(1);
        for at in (0..1_000).map(|ms| t0 + Duration::from_micros(ms)) {
            view.record_hold(7, 5_000, 1, Roundtrip::at(at), second, at);
        }
        let room = |view: &LocalView| {
            let shard = lock(&view.shards[LocalView::shard_index(7)]);
            shard[&7].holds.capacity()
        };
        assert!(room(&view) >= 1_000);
        let later = t0 + 2 * second;
        view.record_hold(7, 5_000, 1, Roundtrip::at(later), second, later);
        assert_eq!(view.quota(7, 5_000, later).remaining, 4_999);
        assert!(room(&view) <= HOLDS_ROOM_KEPT, "{}", room(&view));
    }

    /// Three of five held, expiring in 5, 10 and 20 s: were 2 more held for the window (30 s), a
    /// cost of 2 would fit once two of the three are back (10 s, and the margin); nothing is
    /// recorded by asking.
    #[test]
    fn fits_after_hold_counts_the_pretend_hold_without_recording_it() {
        let view = LocalView::new(100, MARGIN);
        let t0 = Instant::now();
        let wall = SystemTime::now();
        let expiries = [5, 10, 20].map(Duration::from_secs);
        list(&view, 7, &ledger_view(5, &expiries, wall), t0, wall);
        let fits = view.fits_after_hold(7, 2, (2, WINDOW), t0);
        assert_eq!(fits, Some(Duration::from_secs(10) + MARGIN));
        assert_eq!(view.quota(7, 5, t0).remaining, 2, "not recorded");
        // Above the credit, it never fits: then when everything known is back, a window on.
        let never = view.fits_after_hold(7, 6, (2, WINDOW), t0);
        assert_eq!(never, Some(WINDOW + MARGIN));
        assert_eq!(
            view.fits_after_hold(8, 1, (2, WINDOW), t0),
            None,
            "not known"
        );
    }

    /// A recharge above the old hold's units may record more than the ledger took (other
    /// instances' holds, unknown here, leave less free there): the caller is then not refused
    /// from memory until the ledger's word is read again.
    #[test]
    fn a_recharge_above_the_estimate_is_not_refused_from_memory() {
        // Verified by a listing (nothing held), then one hold of 1 answered after it.
        let view = LocalView::new(100, MARGIN);
        let t0 = Instant::now();
        let wall = SystemTime::now();
        list(&view, 7, &ledger_view(5, &[], wall), t0, wall);
        let answered_at = t0 + Duration::from_millis(1);
        view.record_hold(7, 5, 1, Roundtrip::at(answered_at), WINDOW, answered_at);
        let old = LocalRecharge {
            amount: 1,
            expires_at: answered_at + WINDOW + MARGIN,
        };
        view.recharge(7, old, 4, answered_at);
        let quota = view.quota(7, 5, answered_at);
        assert_eq!(quota.remaining, 1, "what this instance thinks held");
        assert!(
            view.check(7, 2, answered_at).is_none(),
            "not refused from memory: the ledger may have taken less, and decides"
        );
    }

    /// A recharge of a hold the view cannot tell apart (merged, or never recorded) forgets the
    /// caller: recording the new one beside it counted the old units twice.
    #[test]
    fn a_recharge_of_a_hold_not_told_apart_forgets_the_caller() {
        // Never listed: what it knows is its own holds.
        let view = LocalView::new(100, MARGIN);
        let t0 = Instant::now();
        let answered_at = t0 + Duration::from_millis(1);
        view.record_hold(7, 5, 1, Roundtrip::at(answered_at), WINDOW, answered_at);
        assert_eq!(view.quota(7, 5, answered_at).remaining, 4);
        let unknown = LocalRecharge {
            amount: 2,
            expires_at: answered_at + WINDOW + MARGIN,
        };
        view.recharge(7, unknown, 3, answered_at);
        let quota = view.quota(7, 5, answered_at);
        assert_eq!(quota.remaining, 5, "forgotten: the credit, not 5 - 1 - 3");
    }

    #[test]
    fn a_hold_voided_after_the_listing_is_not_held_any_more() {
        // A hold recorded here, then listed by the ledger (with the ledger's expiry) as one of
        // the five that exhaust the caller.
        let (view, t0, listed_at) = listed_after_one_recorded(5);
        assert!(view.check(7, 1, listed_at).is_some(), "exhausted");
        // Its request is refunded: the hold is voided, and must not be counted on.
        view.release(7, 1, t0 + WINDOW + MARGIN);
        assert!(
            view.check(7, 1, listed_at).is_none(),
            "a unit is free in the ledger: ask it"
        );
    }

    #[test]
    fn rejects_only_on_the_ledgers_word() {
        let view = LocalView::new(100, MARGIN);
        let t0 = Instant::now();
        let wall = SystemTime::now();
        assert!(
            view.check(7, 1, t0).is_none(),
            "unknown callers go to the ledger"
        );
        for i in 0..5 {
            let q = view.record_hold(7, 5, 1, Roundtrip::at(t0), WINDOW, t0);
            assert_eq!(q.remaining, 4 - i);
        }
        // The plan's capacity is only a guess at the credit (an operator may have topped it up).
        assert!(view.check(7, 1, t0).is_none(), "the ledger has not said");
        list(&view, 7, &ledger_view(5, &[WINDOW; 5], wall), t0, wall);
        let limit = view.check(7, 1, t0).expect("exhausted");
        assert_eq!(limit.retry_after, WINDOW + MARGIN);
        assert_eq!(limit.quota.remaining, 0);
        assert!(!limit.blocked);
        view.clear(t0);
        assert!(
            view.check(7, 1, t0).is_none(),
            "an operator acted: ask again"
        );
        list(&view, 7, &ledger_view(5, &[WINDOW; 4], wall), t0, wall);
        // A hold answered after the listing.
        let t1 = t0 + Duration::from_millis(1);
        view.record_hold(7, 5, 1, Roundtrip::at(t1), WINDOW, t1);
        assert!(
            view.check(7, 1, t1).is_some(),
            "the ledger's word stands across holds"
        );
        // A top-up the ledger reports is believed.
        list(&view, 7, &ledger_view(6, &[WINDOW; 5], wall), t0, wall);
        assert!(view.check(7, 1, t0).is_none());
        assert!(view.check(7, 2, t0).is_some());
        view.forget(7);
        assert!(view.check(7, 2, t0).is_none());
    }

    #[test]
    fn a_block_refuses_until_it_ends() {
        let view = LocalView::new(100, MARGIN);
        let t0 = Instant::now();
        let wall = SystemTime::now();
        let block = Duration::from_secs(60);
        let blocked = blocked_view(Some(wall + block), wall);
        list(&view, 3, &blocked, t0, wall);
        let limit = view.check(3, 1, t0).expect("blocked");
        assert!(limit.blocked);
        assert_eq!(limit.retry_after, block + MARGIN);
        let unknown_end = blocked_view(None, wall);
        list(&view, 3, &unknown_end, t0, wall);
        assert_eq!(view.check(3, 1, t0).unwrap().retry_after, WINDOW);
    }

    /// An operator acts anywhere and every instance clears its view: the blocks it read still
    /// answer for the failure policy (and only there), until the caller is heard of again.
    #[test]
    fn a_block_outlives_a_clear_for_the_failure_policy_alone() {
        let view = LocalView::new(100, MARGIN);
        let t0 = Instant::now();
        let wall = SystemTime::now();
        let hour = Duration::from_secs(3600);
        for id in [3, 4, 5, 6, 7, 8] {
            list(&view, id, &blocked_view(Some(wall + hour), wall), t0, wall);
        }
        view.clear(t0);
        assert!(view.check(3, 1, t0).is_none(), "the ledger decides again");
        let kept = view.known_block(3, t0).expect("kept");
        assert!(kept.blocked);
        // The act behind the clear may have lifted it: asked again within a minute.
        assert_eq!(kept.retry_after, BLOCK_TRUSTED_FOR);
        // A forget of holds this instance cannot follow keeps it; a listing that reads the block
        // again keeps it too, stored or not (here not: a forget in its shard since it was read).
        view.forget(7);
        assert!(view.known_block(7, t0).is_some(), "a forget of holds");
        let read = view.generation(8);
        view.forget(8 + 64);
        let listed = Listing {
            view: &blocked_view(Some(wall + hour), wall),
            read,
        };
        view.replace(8, listed, 0, WINDOW, t0, wall);
        assert!(
            view.known_block(8, t0).is_some(),
            "read blocked again, not stored"
        );
        // Heard of since: a listing that reads it unblocked, a hold the ledger admitted, an
        // operator's unblock here. Each is newer than the block; a hold sent before the block
        // was read is not, however late its answer was read.
        let t1 = t0 + Duration::from_millis(1);
        list(&view, 4, &ledger_view(5, &[], wall), t1, wall);
        assert!(view.known_block(4, t1).is_none(), "listed unblocked");
        let before = t0 - Duration::from_millis(1);
        view.record_hold(5, 5, 1, Roundtrip::at(before), hour, t1);
        assert!(view.known_block(5, t1).is_some(), "a hold answered before");
        let read_late = Roundtrip {
            sent_at: before,
            answered_at: t1,
        };
        view.record_hold(5, 5, 1, read_late, hour, t1);
        assert!(view.known_block(5, t1).is_some(), "a hold sent before");
        view.record_hold(5, 5, 1, Roundtrip::at(t1), hour, t1);
        assert!(view.known_block(5, t1).is_none(), "a hold admitted since");
        view.forget_acted_on(6, BlockAct::Lifted, t0);
        assert!(view.known_block(6, t0).is_none(), "unblocked here");
        // A second clear keeps what the first kept, and the bound holds.
        view.clear(t0);
        assert!(view.known_block(3, t0).is_some());
        assert_eq!(view.blocks_kept_count.load(Ordering::Relaxed), 3);
        assert!(view.known_block(3, t0 + hour + MARGIN).is_none(), "over");
        assert_eq!(
            view.blocks_kept_count.load(Ordering::Relaxed),
            2,
            "3 is gone"
        );
        view.clear(t0 + hour + MARGIN);
        assert_eq!(
            view.blocks_kept_count.load(Ordering::Relaxed),
            0,
            "all over"
        );
    }

    /// An operator's act here tells the failure policy what became of the caller's block: a retry
    /// leaves the block read, a block made here stands at once (the ledger unread), an unblock
    /// ends it. A kept block the shard has newer word of (unblocked: a race of a hold admitted
    /// with a clear) is not kept again by the next clear.
    #[test]
    fn an_operators_act_here_says_what_became_of_the_block() {
        let view = LocalView::new(100, MARGIN);
        let t0 = Instant::now();
        let wall = SystemTime::now();
        let hour = Duration::from_secs(3600);
        list(&view, 3, &blocked_view(Some(wall + hour), wall), t0, wall);
        view.forget_acted_on(3, BlockAct::Unchanged, t0);
        assert!(view.check(3, 1, t0).is_none(), "the ledger decides again");
        assert!(
            view.known_block(3, t0).is_some(),
            "a retried act proves nothing"
        );
        view.forget_acted_on(4, BlockAct::Blocked(t0 + hour), t0);
        assert!(view.known_block(4, t0).is_some(), "blocked here, unread");
        view.forget_acted_on(4, BlockAct::Lifted, t0);
        assert!(view.known_block(4, t0).is_none(), "unblocked here");
        view.forget_acted_on(5, BlockAct::Unchanged, t0);
        assert!(view.known_block(5, t0).is_none(), "no block read");
        // Any other forget (a void that failed, a release) keeps the block it read, too.
        list(&view, 9, &blocked_view(Some(wall + hour), wall), t0, wall);
        view.forget(9);
        assert!(view.check(9, 1, t0).is_none(), "the ledger decides again");
        assert!(view.known_block(9, t0).is_some(), "a block read, forgotten");
        // A listing asked for before an unblock here reads the block: stale, not stored, and
        // kept a minute at most (stale from any change in its shard, it may be a block still).
        view.forget_acted_on(12, BlockAct::Blocked(t0 + hour), t0);
        let read = view.generation(12);
        view.forget_acted_on(12, BlockAct::Lifted, t0);
        let listed = Listing {
            view: &blocked_view(Some(wall + hour), wall),
            read,
        };
        view.replace(12, listed, 0, WINDOW, t0, wall);
        let stale = view.known_block(12, t0).expect("a minute at most");
        assert_eq!(stale.retry_after, BLOCK_TRUSTED_FOR);
        let later = t0 + BLOCK_TRUSTED_FOR;
        assert!(
            view.known_block(12, later).is_none(),
            "a stale listing, over"
        );
        // A listing asked for before a block made here reads the account open: stale, it does
        // not end the block.
        let read = view.generation(13);
        view.forget_acted_on(13, BlockAct::Blocked(t0 + hour), t0);
        let listed = Listing {
            view: &ledger_view(5, &[], wall),
            read,
        };
        view.replace(13, listed, 0, WINDOW, t0 + Duration::from_millis(1), wall);
        assert!(
            view.known_block(13, t0).is_some(),
            "read open before the block"
        );
        list(&view, 6, &ledger_view(5, &[], wall), t0, wall);
        let before = t0 - Duration::from_millis(1);
        let stale = KeptBlock {
            until: t0 + hour,
            learned_at: before,
        };
        view.blocks_kept.lock().unwrap().insert(6, stale);
        view.clear(t0);
        assert!(
            view.known_block(6, t0).is_none(),
            "the shard's word was newer"
        );
        assert!(view.known_block(3, t0).is_some());
    }

    #[test]
    fn a_long_block_is_read_again_after_a_minute() {
        let view = LocalView::new(100, MARGIN);
        let t0 = Instant::now();
        let wall = SystemTime::now();
        let week = Duration::from_secs(7 * 24 * 3600);
        list(&view, 3, &blocked_view(Some(wall + week), wall), t0, wall);
        let later = t0 + BLOCK_TRUSTED_FOR - Duration::from_millis(1);
        assert!(view.check(3, 1, later).expect("blocked").blocked);
        // An unblock this instance did not hear of ends here: the ledger decides again, even
        // for a caller whose holds use up its credit (refused as rate limited otherwise).
        assert!(view.check(3, 1, t0 + BLOCK_TRUSTED_FOR).is_none());
        let spent = AccountView {
            blocked: blocked_view(Some(wall + week), wall).blocked,
            ..ledger_view(5, &[Duration::from_secs(3600); 5], wall)
        };
        list(&view, 4, &spent, t0, wall);
        assert!(view.check(4, 1, t0).expect("blocked").blocked);
        assert!(view.check(4, 1, t0 + BLOCK_TRUSTED_FOR).is_none());
        // Yet while the ledger cannot be asked, the block it last said stands.
        let known = view.known_block(4, t0 + BLOCK_TRUSTED_FOR).expect("known");
        assert!(known.blocked);
        // Read over a minute ago, perhaps lifted since: told to come back within a minute, not
        // at the block's end (a week).
        assert_eq!(known.retry_after, BLOCK_TRUSTED_FOR);
        assert!(view.known_block(4, t0 + week + MARGIN).is_none(), "over");
        // A fresh listing of the same block refuses from memory again, until its own end.
        let then = t0 + BLOCK_TRUSTED_FOR;
        let wall_then = wall + BLOCK_TRUSTED_FOR;
        list(
            &view,
            3,
            &blocked_view(Some(wall + week), wall_then),
            then,
            wall_then,
        );
        let limit = view.check(3, 1, then).expect("blocked");
        assert_eq!(limit.retry_after, week - BLOCK_TRUSTED_FOR + MARGIN);
    }

    #[test]
    fn a_listing_read_before_an_operator_acted_is_not_stored_after() {
        let view = LocalView::new(100, MARGIN);
        let t0 = Instant::now();
        let wall = SystemTime::now();
        let blocked = blocked_view(Some(wall + Duration::from_secs(7 * 24 * 3600)), wall);
        // Read while blocked, then a change before the listing is stored: the listing answers
        // its refusal all the same, and is stored only if nothing in its shard (3 of 64)
        // changed meanwhile.
        type Change = fn(&LocalView);
        let changes: [(&str, Change, bool); 4] = [
            // An operator unblocks it everywhere: the epoch follower clears the view.
            ("a clear", |view| view.clear(Instant::now()), false),
            // Unblocked on this instance: the admin API forgets the caller.
            ("its forget", |view| view.forget(3), false),
            // Another shard's forget (Envoy's releases of other callers).
            ("another shard's forget", |view| view.forget(4), true),
            // A hold voided in its shard, which the listing may list still.
            (
                "a release in its shard",
                |view| view.release(3 + SHARD_COUNT as u128, 1, Instant::now()),
                false,
            ),
        ];
        for (name, change, stored) in changes {
            view.forget(3);
            let read = view.generation(3);
            change(&view);
            let listing = Listing {
                view: &blocked,
                read,
            };
            let answer = view.replace(3, listing, 1, WINDOW, t0, wall);
            assert!(
                answer.expect("the ledger's word at the time").blocked,
                "{name}"
            );
            assert_eq!(view.check(3, 1, t0).is_some(), stored, "after {name}");
        }
        // A listing read after a change is stored.
        list(&view, 3, &blocked, t0, wall);
        assert!(view.check(3, 1, t0).expect("blocked").blocked);
    }

    #[test]
    fn retry_after_waits_for_enough_credit_for_the_cost() {
        let view = LocalView::new(100, MARGIN);
        let t0 = Instant::now();
        let wall = SystemTime::now();
        let expiries = [10, 20, 30].map(Duration::from_secs);
        list(&view, 1, &ledger_view(3, &expiries, wall), t0, wall);
        let limit = view.check(1, 2, t0).unwrap();
        assert_eq!(limit.retry_after, Duration::from_secs(20) + MARGIN);
        // Its `t`: when enough is back for it, as its Retry-After (more is back at 10 s).
        assert_eq!(limit.quota.reset_after, limit.retry_after);
        let quota = view.quota(1, 3, t0);
        assert_eq!(quota.reset_after, Duration::from_secs(10) + MARGIN);
        // More than the whole credit never fits: when all is back, not "now".
        let limit = view.check(1, 4, t0).unwrap();
        assert_eq!(limit.retry_after, Duration::from_secs(30) + MARGIN);
        list(&view, 2, &ledger_view(3, &[], wall), t0, wall);
        assert_eq!(
            view.check(2, 4, t0).unwrap().retry_after,
            NEVER_FITS_RETRY_MIN
        );
    }

    #[test]
    fn ledger_view_replaces_local_knowledge() {
        let view = LocalView::new(100, MARGIN);
        let now = Instant::now();
        let wall = SystemTime::now();
        let ledger = AccountView {
            credit: 5,
            granted: true,
            available: 0,
            holds: (1..=5)
                .map(|s| Hold {
                    id: u128::from(s),
                    amount: 1,
                    expires_at: wall + Duration::from_secs(s),
                    leased_at: None,
                })
                .collect(),
            complete: true,
            blocked: None,
        };
        list(&view, 9, &ledger, now, wall);
        let limit = view.check(9, 2, now).unwrap();
        assert_eq!(limit.retry_after, Duration::from_secs(2) + MARGIN);
        let incomplete = AccountView {
            holds: vec![],
            complete: false,
            ..ledger
        };
        list(&view, 9, &incomplete, now, wall);
        // Nothing listed: the unlisted holds may expire any moment, so nothing is refused.
        assert!(view.check(9, 1, now).is_none());
    }

    #[test]
    fn room_is_for_a_view_that_is_on() {
        let now = Instant::now();
        assert!(!LocalView::new(0, MARGIN).has_room_for(1), "off: no room");
        // One caller per shard: a known caller has room, and so has one whose shard is empty.
        let view = LocalView::new(SHARD_COUNT, MARGIN);
        view.record_hold(1, 5, 1, Roundtrip::at(now), WINDOW, now);
        assert!(view.has_room_for(1));
        // Shards are picked by the id's low bits.
        let (full, empty) = (1 + SHARD_COUNT as u128, 2);
        assert!(!view.has_room_for(full), "its shard is full");
        assert!(view.has_room_for(empty));
    }

    /// A full shard forgets callers with nothing live, but not a block while it lasts: a blocked
    /// caller places no holds, so it went first, and a ledger failure under the open policy
    /// then admitted it (the known block is what refuses it then).
    #[test]
    fn a_full_shard_keeps_a_block_while_it_lasts() {
        let view = LocalView::new(SHARD_COUNT, MARGIN);
        let (now, wall) = (Instant::now(), SystemTime::now());
        let blocked = blocked_view(Some(wall + Duration::from_secs(3600)), wall);
        list(&view, 1, &blocked, now, wall);
        assert!(view.known_block(1, now).is_some());
        // Another caller of the same shard, a window later: no room (the block is live).
        let later = now + WINDOW + Duration::from_secs(1);
        view.record_hold(
            1 + SHARD_COUNT as u128,
            5,
            1,
            Roundtrip::at(later),
            WINDOW,
            later,
        );
        assert!(view.known_block(1, later).is_some(), "kept");
        assert!(!view.has_room_for(1 + SHARD_COUNT as u128));
    }

    /// A full shard whose sweep frees nothing is not swept again until its first entry ends:
    /// each new caller that found no room swept it all, under its lock.
    #[test]
    fn a_full_shard_is_swept_again_only_once_something_can_go() {
        let view = LocalView::new(SHARD_COUNT, MARGIN);
        let now = Instant::now();
        view.record_hold(1, 5, 1, Roundtrip::at(now), WINDOW, now);
        let other = 1 + SHARD_COUNT as u128;
        view.record_hold(other, 5, 1, Roundtrip::at(now), WINDOW, now);
        let shard = LocalView::shard_index(1);
        let not_before = *lock(&view.sweep_not_before[shard]);
        assert_eq!(
            not_before,
            Some(now + WINDOW + MARGIN),
            "the first entry's end"
        );
        assert!(!view.has_room_for(other));
        // Once it ends, the next caller finds room.
        let later = now + WINDOW + MARGIN + Duration::from_millis(1);
        view.record_hold(other, 5, 1, Roundtrip::at(later), WINDOW, later);
        assert!(view.has_room_for(other), "stored");
        assert_eq!(*lock(&view.sweep_not_before[shard]), None);
    }

    /// Whether a listing would be kept: room once callers with nothing live are forgotten (not
    /// only room now), and a shard thinned by a forget is not held to its last sweep's time.
    #[test]
    fn a_listing_is_kept_where_room_can_be_made() {
        let view = LocalView::new(SHARD_COUNT, MARGIN);
        let now = Instant::now();
        let other = 1 + SHARD_COUNT as u128;
        view.record_hold(1, 5, 1, Roundtrip::at(now), WINDOW, now);
        assert!(view.can_keep(1, now), "known");
        assert!(
            !view.can_keep(other, now),
            "its shard is full of a live hold"
        );
        let later = now + WINDOW + MARGIN + Duration::from_millis(1);
        assert!(view.can_keep(other, later), "the hold ended: room is made");
        // A full shard, swept (its first end remembered), then thinned by a forget: room at once.
        view.record_hold(1, 5, 1, Roundtrip::at(later), WINDOW, later);
        assert!(!view.can_keep(other, later));
        view.forget(1);
        assert!(view.can_keep(other, later), "thinned since the sweep");
    }

    #[test]
    fn a_view_of_no_callers_remembers_nothing() {
        let view = LocalView::new(0, MARGIN);
        let now = Instant::now();
        view.record_hold(1, 1, 1, Roundtrip::at(now), WINDOW, now);
        assert!(view.check(1, 1, now).is_none());
        assert_eq!(view.callers(), 0);
    }

    #[test]
    fn a_caller_sharing_a_verified_callers_bit_is_not_refused() {
        let view = LocalView::new(100, MARGIN);
        let t0 = Instant::now();
        let wall = SystemTime::now();
        let verified = 7u128;
        let sharing = verified + ((VERIFIED_FILTER_BITS as u128) << SHARD_COUNT.trailing_zeros());
        assert_eq!(view.verified_bit(verified).1, view.verified_bit(sharing).1);
        assert!(std::ptr::eq(
            view.verified_bit(verified).0,
            view.verified_bit(sharing).0
        ));
        for _ in 0..5 {
            view.record_hold(sharing, 5, 1, Roundtrip::at(t0), WINDOW, t0);
        }
        list(
            &view,
            verified,
            &ledger_view(5, &[WINDOW; 5], wall),
            t0,
            wall,
        );
        assert!(
            view.check(verified, 1, t0).is_some(),
            "exhausted, on the ledger's word"
        );
        assert!(
            view.check(sharing, 1, t0).is_none(),
            "the bit only sends it to its entry, which the ledger has not verified"
        );
    }

    #[test]
    fn clearing_the_view_clears_its_filter() {
        let view = LocalView::new(2 * VERIFIED_FILTER_BITS, MARGIN);
        let t0 = Instant::now();
        let wall = SystemTime::now();
        for n in 0..(2 * VERIFIED_FILTER_BITS as u128) {
            let id = (n << 6) | (n % 64); // every shard, every bit
            list(&view, id, &ledger_view(1, &[WINDOW], wall), t0, wall);
        }
        assert_eq!(view.callers(), 2 * VERIFIED_FILTER_BITS);
        let bits = || -> u32 {
            let words = view.verified_filter.iter();
            words.map(|w| w.load(Ordering::Relaxed).count_ones()).sum()
        };
        assert_eq!(bits() as usize, VERIFIED_FILTER_BITS, "every bit set");
        let refused = (5 << 6) | 5;
        assert!(view.check(refused, 1, t0).is_some());
        view.clear(t0);
        assert_eq!(bits(), 0);
        assert!(
            view.check(refused, 1, t0).is_none(),
            "forgotten: the ledger decides"
        );
        list(&view, refused, &ledger_view(1, &[WINDOW], wall), t0, wall);
        assert!(
            view.check(refused, 1, t0).is_some(),
            "the next refusal sets it again"
        );
    }

    #[test]
    fn caller_count_is_bounded() {
        let view = LocalView::new(64, MARGIN);
        let now = Instant::now();
        let wall = SystemTime::now();
        for id in 0..10_000u128 {
            view.record_hold(id, 5, 1, Roundtrip::at(now), WINDOW, now);
        }
        assert!(view.callers() <= 64, "{}", view.callers());
        // Refused callers too: the ledger's word takes no room a full view does not have.
        for id in 10_000..20_000u128 {
            list(&view, id, &ledger_view(1, &[WINDOW], wall), now, wall);
        }
        assert!(view.callers() <= 64, "{}", view.callers());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// The safety property: against an exact model of the ledger (credit `capacity`, each
        /// admitted request holds `cost` for `window`), the local view never refuses a request
        /// unless the ledger refuses it too, or did so less than the expiry margin ago (the margin
        /// covers TigerBeetle's expiry lag: the view errs towards refusing, never admitting).
        /// As in the limiter, a refusal by the ledger is followed by a read of the account that
        /// the view takes in whole ([`LocalView::replace`]): from then on it refuses on its own,
        /// which every case that reaches a refusal checks (else the property would hold of a view
        /// that never refuses).
        #[test]
        fn never_refuses_what_the_ledger_would_admit(
            capacity in 1u64..20,
            window_ms in 1u64..2000,
            events in proptest::collection::vec((0u64..500, 1u64..5), 1..200),
        ) {
            never_refuses(capacity, window_ms, &events)?;
        }

        /// Holds recorded in the order they expire (one window's): the view counts exactly what
        /// is live while it remembers every hold, and past [`HOLDS_PER_CALLER_MAX`], where it
        /// merges, never more than is live (more would refuse what the ledger admits).
        #[test]
        fn merged_holds_never_outlive_their_units(
            mut expiries in proptest::collection::vec(1u64..100, 1..3000),
            probe in 0u64..120,
        ) {
            expiries.sort_unstable();
            let view = LocalView::new(16, Duration::ZERO);
            let t0 = Instant::now();
            let credit = expiries.len() as u64;
            for e in &expiries {
                view.record_hold(1, credit, 1, Roundtrip::at(t0), Duration::from_secs(*e), t0);
            }
            let at = t0 + Duration::from_secs(probe);
            let truly_held = expiries.iter().filter(|e| **e > probe).count() as u64;
            let view_held = credit - view.quota(1, credit, at).remaining;
            prop_assert!(view_held <= truly_held, "{view_held} held, {truly_held} live");
            if expiries.len() <= HOLDS_PER_CALLER_MAX {
                prop_assert_eq!(view_held, truly_held);
            }
        }
    }

    /// [`never_refuses_what_the_ledger_would_admit`]'s check of one case: `events` are (gap in
    /// ms, cost) pairs, one request each.
    fn never_refuses(
        capacity: u64,
        window_ms: u64,
        events: &[(u64, u64)],
    ) -> Result<(), TestCaseError> {
        let view = LocalView::new(16, MARGIN);
        let window = Duration::from_millis(window_ms);
        let (t0, wall0) = (Instant::now(), SystemTime::now());
        let mut now = t0;
        let mut ledger: Vec<(Instant, u64)> = Vec::new(); // (expires_at, amount)
        for &(gap_ms, cost) in events {
            now += Duration::from_millis(gap_ms);
            let held = |margin: Duration| -> u64 {
                ledger
                    .iter()
                    .filter(|(e, _)| *e + margin > now)
                    .map(|(_, a)| a)
                    .sum()
            };
            let ledger_admits = capacity.saturating_sub(held(Duration::ZERO)) >= cost;
            let ledger_admitted_all_margin_long = capacity.saturating_sub(held(MARGIN)) >= cost;
            let local_refuses = view.check(1, cost, now).is_some();
            prop_assert!(
                !(local_refuses && ledger_admitted_all_margin_long),
                "refused what the ledger has admitted for longer than the margin"
            );
            if local_refuses {
                continue;
            }
            if ledger_admits {
                // The ledger stamps the hold no later than its answer arrives.
                ledger.push((now + window, cost));
                view.record_hold(1, capacity, cost, Roundtrip::at(now), window, now);
                continue;
            }
            let wall = |at: Instant| wall0 + (at - t0);
            let holds: Vec<Hold> = ledger
                .iter()
                .filter(|(e, _)| *e > now)
                .enumerate()
                .map(|(id, (e, a))| Hold {
                    id: id as u128,
                    amount: *a,
                    expires_at: wall(*e),
                    leased_at: None,
                })
                .collect();
            let account = AccountView {
                credit: capacity,
                granted: capacity > 0,
                available: capacity - held(Duration::ZERO),
                holds,
                complete: true,
                blocked: None,
            };
            let listing = Listing {
                view: &account,
                read: view.generation(1),
            };
            view.replace(1, listing, cost, window, now, wall(now));
            prop_assert!(
                view.check(1, cost, now).is_some(),
                "the ledger's word refuses locally"
            );
        }
        Ok(())
    }

    /// The case `proptest-regressions/limiter/local_view.txt`'s seed shrank to, pinned as itself
    /// (a seed replays another case once the strategy changes).
    #[test]
    fn a_hold_of_the_whole_capacity_then_one_more_request() {
        never_refuses(2, 1, &[(0, 2), (1, 1)]).unwrap();
    }
}
