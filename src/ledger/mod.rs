//! The one place that talks to TigerBeetle.
//!
//! Every call here has a deadline (TigerBeetle requests never time out on their own, and dropping
//! a request's future does not cancel it) and is bounded: at most `in_flight_max` calls are in
//! flight, and a call beyond that is refused at once rather than queued (but a give-back, which
//! refused would be lost, waits for a place until its deadline: `Place`). The task that talks to
//! the ledger owns each call's in-flight permit until the ledger answers (a call's own task, or
//! for single transfers the task of their batch, `batch.rs`), so a dead ledger fills the bound
//! and further calls fail fast instead of piling up inside the client.

pub mod addresses;
pub mod audit;
pub mod batch;
pub mod chain;
mod connection;
pub mod embedded;
pub mod lease;
pub mod metrics;
pub mod model;
pub mod moves;
pub mod operator;
pub mod release;
pub mod settle;

pub use moves::Moving;
pub use operator::{Adjusted, Blocking, Unblocking};

use std::future::Future;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use arc_swap::ArcSwap;
use tb::error::{CreateAccountErrorKind, CreateTransferErrorKind};
use thiserror::Error;
use tigerbeetle_unofficial as tb;
use tokio::sync::{oneshot, Semaphore};
use tracing::Instrument;

use crate::sync::lock;

pub use chain::{ChainLink, ChainReply, LinkRefusal, CHAIN_LINKS_MAX};
use connection::Connection;
pub use connection::{RETIRED_CALLS_GRACE, RETIRED_CLIENTS_MAX};
use metrics::{CallStatus, LedgerErrorKind, LedgerMetrics, Operation};
use model::UserAccount;

/// TigerBeetle answers at most this many transfers per `get_account_transfers` page in
/// `--development` mode (32 KiB messages); production allows more, but pages this size work in both.
pub const TRANSFERS_PAGE_LIMIT: u32 = 254;
/// How many pages of holds [`Ledger::account_view`] reads before giving up on precision.
pub const TRANSFERS_PAGES_MAX: usize = 16;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum LedgerError {
    #[error("ledger call {} missed its deadline", .operation.as_str())]
    Timeout { operation: Operation },
    #[error("too many ledger calls in flight ({in_flight_max})")]
    Overloaded { in_flight_max: usize },
    #[error("ledger client failed {}: {message}", .operation.as_str())]
    Client {
        operation: Operation,
        message: String,
        /// The client can send nothing more (evicted by the cluster, or closed): the next call
        /// replaces it (see `ledger::connection`).
        client_gone: bool,
    },
    #[error("ledger answered {} with {message}", .operation.as_str())]
    Unexpected {
        operation: Operation,
        message: String,
    },
}

tokio::task_local! {
    /// Set while an operator's action runs ([`as_operator_action`]).
    static OPERATOR_ACTION: ();
}

/// Runs an operator's action (the admin API's): each of its ledger calls, its reads included
/// (an unblock's lookup, a move's listings), waits for a place under the in-flight bound within
/// its deadline, where a decision's is refused at once. A flood that fills the bound is when an
/// operator acts, and a read refused at once failed the action with a 503.
pub async fn as_operator_action<F: Future>(action: F) -> F::Output {
    OPERATOR_ACTION.scope((), action).await
}

/// `future`, an operator's action if the task making it is one: for a future spawned as a task
/// of its own, which does not inherit the task-local.
fn keep_operator_action<F: Future>(future: F) -> impl Future<Output = F::Output> {
    let operator = OPERATOR_ACTION.try_with(|()| ()).is_ok();
    async move {
        match operator {
            true => as_operator_action(future).await,
            false => future.await,
        }
    }
}

/// How often a client the cluster evicted is replaced at most (`Ledger::connection`).
pub const EVICTED_REPLACE_INTERVAL: Duration = Duration::from_secs(1);

/// The wall-clock seconds an eviction, and too many replaced clients still open, were last
/// logged in ([`crate::telemetry::log_throttle`]).
static EVICTION_LOGGED_SECOND: AtomicU64 = AtomicU64::new(0);
static RETIRED_LOGGED_SECOND: AtomicU64 = AtomicU64::new(0);

/// A child of the request's span. Outside one (an untraced request, a readiness probe) no span at
/// all: a probe's call must not become a trace of its own.
fn call_span(operation: Operation) -> tracing::Span {
    if tracing::Span::current().is_disabled() {
        return tracing::Span::none();
    }
    tracing::info_span!(
        "ledger",
        otel.name = operation.as_str(),
        otel.kind = "client",
        db.system.name = "tigerbeetle",
        db.operation.name = operation.as_str(),
        ledger.outcome = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
        otel.status_description = tracing::field::Empty,
    )
}

/// A request's pending debit that the ledger has not released yet (`None` for anything else: a
/// grant, a reduction, a void, a block). Voided ones are removed by the caller.
fn live_hold(transfer: &tb::Transfer, now: SystemTime) -> Option<(u128, Hold)> {
    let pending = transfer.flags().contains(tb::transfer::Flags::PENDING);
    let request = matches!(
        transfer.code(),
        model::TRANSFER_CODE_REQUEST
            | model::TRANSFER_CODE_CARRY
            | lease::TRANSFER_CODE_LEASE
            | lease::TRANSFER_CODE_LEASE_SETTLEMENT
    );
    let expires_at = transfer.timestamp() + Duration::from_secs(u64::from(transfer.timeout()));
    (pending && request && transfer.timeout() > 0 && expires_at > now).then(|| {
        let amount = u64::try_from(transfer.amount()).unwrap_or(u64::MAX);
        let leased_at =
            (transfer.code() == lease::TRANSFER_CODE_LEASE).then(|| transfer.timestamp());
        let hold = Hold {
            id: transfer.id(),
            amount,
            expires_at,
            leased_at,
        };
        (transfer.id(), hold)
    })
}

/// The pending transfer a void or post resolved, if `transfer` is one.
fn resolved_pending(transfer: &tb::Transfer) -> Option<u128> {
    let resolves =
        tb::transfer::Flags::VOID_PENDING_TRANSFER | tb::transfer::Flags::POST_PENDING_TRANSFER;
    transfer
        .flags()
        .intersects(resolves)
        .then(|| transfer.pending_id())
}

/// The deadline of a follow-up to an action the ledger has done (an operator epoch's bump, a
/// move's second pass): the action's deadline may be spent by now, and a call past its deadline
/// is not sent, so the follow-up has at least a second of its own.
pub fn follow_up_deadline(deadline: Instant) -> Instant {
    deadline.max(Instant::now() + Duration::from_secs(1))
}

/// A transfer result the model does not expect (`what`: which transfer, for the message).
fn unexpected_transfer(what: &str, kind: CreateTransferErrorKind) -> LedgerError {
    LedgerError::Unexpected {
        operation: Operation::CreateTransfers,
        message: format!("{what}{kind:?}"),
    }
}

/// The client reported a failed call without naming the failed event: never seen, but an answer
/// from outside, so an error rather than an index that could panic.
fn no_event_error(operation: Operation) -> LedgerError {
    LedgerError::Unexpected {
        operation,
        message: "an error without a failed event".to_owned(),
    }
}

fn client_error(operation: Operation, error: impl std::error::Error + 'static) -> LedgerError {
    LedgerError::Client {
        operation,
        message: error.to_string(),
        client_gone: connection::is_client_gone(&error),
    }
}

impl LedgerError {
    /// Whether the client can send nothing more (see [`LedgerError::Client`]).
    pub fn is_client_gone(&self) -> bool {
        matches!(
            self,
            LedgerError::Client {
                client_gone: true,
                ..
            }
        )
    }

    pub fn kind(&self) -> LedgerErrorKind {
        match self {
            LedgerError::Timeout { .. } => LedgerErrorKind::Timeout,
            LedgerError::Overloaded { .. } => LedgerErrorKind::Overloaded,
            LedgerError::Client { .. } => LedgerErrorKind::Client,
            LedgerError::Unexpected { .. } => LedgerErrorKind::Unexpected,
        }
    }
}

/// When a transfer went to the ledger and when its answer was read.
///
/// The ledger answers one client's calls in the order they went, so a hold sent before a read of
/// its account went is in what that read lists: `sent_at`, taken before the hold is handed to
/// the client, tells the local view which holds a listing already counts
/// (`LocalView::record_hold`). The answer's instant would not: the task that reads it may be
/// polled well after it arrived, and a hold the listing counts was then counted twice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Roundtrip {
    /// No later than the transfer was handed to the client.
    pub sent_at: Instant,
    /// No earlier than the ledger's answer arrived: the transfer's timestamp is no later, so
    /// `answered_at + timeout` bounds a hold's expiry from above.
    pub answered_at: Instant,
}

impl Roundtrip {
    /// Sent and answered at one instant (the tests' ledgers answer at once).
    pub fn at(instant: Instant) -> Self {
        Roundtrip {
            sent_at: instant,
            answered_at: instant,
        }
    }
}

/// The ledger's answer to a hold (a pending debit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldReply {
    /// Credit is held: when it went and when its answer came ([`Roundtrip`]).
    Held {
        roundtrip: Roundtrip,
        /// The pending transfer, to void it (a refund).
        transfer_id: u128,
    },
    /// `exceeds_credits`: the caller's credit is all held. The decision is "limited".
    ExceedsCredits,
    /// `debit_account_not_found`: a new caller; provision, then retry once.
    AccountNotFound,
    /// `debit_account_already_closed`: an operator blocked the caller.
    Blocked,
}

/// A hold the ledger reports as still pending.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hold {
    /// The pending transfer's id.
    pub id: u128,
    pub amount: u64,
    /// When the ledger will release it, in ledger (wall-clock) time.
    pub expires_at: SystemTime,
    /// For a lease: when the ledger placed it. Its instance settles it about L later (unless it
    /// died), long before `expires_at`, which covers the window after L.
    pub leased_at: Option<SystemTime>,
}

/// What the ledger says about one user account: its available credit and its live holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccountView {
    /// credits_posted − debits_posted: the credit when nothing is held.
    pub credit: u64,
    /// Whether the account was ever credited (credits_posted > 0): its grant landed. A credit of
    /// 0 alone does not say so: an operator may have reduced it all.
    pub granted: bool,
    /// credits_posted − debits_posted − debits_pending.
    pub available: u64,
    /// Live holds, earliest expiry first. `complete` is false when there were too many to read.
    pub holds: Vec<Hold>,
    pub complete: bool,
    /// While an operator's block lasts (the account is closed): when it ends, if found.
    pub blocked: Option<Blocked>,
}

/// An account's credit when nothing is held (credits_posted − debits_posted), and what it has
/// free now (less debits_pending): the one formula every read of an account uses.
pub(crate) fn credit_and_available(account: &tb::Account) -> (u128, u128) {
    let credit = (account.credits_posted()).saturating_sub(account.debits_posted());
    (credit, credit.saturating_sub(account.debits_pending()))
}

/// What one lookup says of a user account, without listing its holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AccountFree {
    /// credits_posted − debits_posted: the credit when nothing is held.
    pub credit: u64,
    /// Whether the account was ever credited (its grant landed).
    pub granted: bool,
    /// credits_posted − debits_posted − debits_pending.
    pub available: u64,
    /// An operator closed it: a block, or a move.
    pub closed: bool,
}

impl From<&AccountView> for AccountFree {
    fn from(view: &AccountView) -> Self {
        AccountFree {
            credit: view.credit,
            granted: view.granted,
            available: view.available,
            closed: view.blocked.is_some(),
        }
    }
}

/// An operator closed the account: a block, or a move to another plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Blocked {
    /// When the block's timeout ends it (`None`: a move, or its transfer could not be found).
    pub until: Option<SystemTime>,
    /// The caller moved to the plan of this [`model::plan_tag`].
    pub moved_to: Option<u64>,
}

#[derive(Debug, Clone)]
pub struct LedgerSettings {
    pub cluster_id: u128,
    pub addresses: Vec<SocketAddr>,
    pub ledger_id: u32,
    pub in_flight_max: NonZeroUsize,
    /// How long a batch of single transfers waits for more before it goes (`batch.rs`); zero:
    /// it goes once its thread has run what it had ready. At most [`BATCH_LINGER_MAX`].
    pub batch_linger: Duration,
}

pub use batch::BATCH_LINGER_MAX;

/// A handle on the ledger, cheap to clone; every clone shares one TigerBeetle client (which batches
/// concurrent requests by itself). The client is replaced only when the replicas' addresses change
/// ([`Ledger::reconnect`]), or when it can send nothing more (evicted by the cluster, or of a
/// release it no longer serves: the next call replaces it).
#[derive(Clone)]
pub struct Ledger {
    client: Arc<ArcSwap<Connection>>,
    /// Connections [`Ledger::reconnect`] replaced, until they close (`connection.rs`).
    retired: Arc<Mutex<Vec<Arc<Connection>>>>,
    /// When a client the cluster evicted was last replaced (taken under `retired`'s lock).
    evicted_replaced_at: Arc<Mutex<Option<Instant>>>,
    cluster_id: u128,
    in_flight: Arc<Semaphore>,
    in_flight_max: usize,
    ledger_id: u32,
    metrics: Arc<LedgerMetrics>,
    /// Every call started, refused ones included, by operation ([`Operation`] order): lets an
    /// operator (and a test) see that a request cost no ledger call at all.
    calls_started: Arc<[AtomicU64; Operation::ALL.len()]>,
    /// How batches of single transfers go, and how many went.
    batching: Arc<batch::Batching>,
    /// Moves' second passes running in the background, or waiting for a lost move's late
    /// answer (`moves.rs`).
    second_passes: crate::outstanding::Outstanding,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger")
            .field("ledger_id", &self.ledger_id)
            .field("in_flight_max", &self.in_flight_max)
            .finish()
    }
}

#[derive(Debug, Error)]
pub enum ConnectError {
    #[error("no TigerBeetle replica address given")]
    NoAddresses,
    #[error("cannot create the TigerBeetle client: {0}")]
    Client(String),
    #[error("a batch linger of {linger:?} is longer than the most, {BATCH_LINGER_MAX:?}")]
    BatchLinger { linger: Duration },
}

impl Ledger {
    /// Creates the client. It connects lazily: a ledger that is down shows up as call timeouts.
    /// Install the `metrics` recorder first: the ledger's metrics bind to it here.
    pub fn connect(settings: &LedgerSettings) -> Result<Self, ConnectError> {
        let linger = settings.batch_linger;
        if linger > BATCH_LINGER_MAX {
            return Err(ConnectError::BatchLinger { linger });
        }
        let connection = Connection::new(settings.cluster_id, &settings.addresses)?;
        Ok(Ledger {
            client: Arc::new(ArcSwap::from_pointee(connection)),
            retired: Arc::new(Mutex::new(Vec::new())),
            evicted_replaced_at: Arc::new(Mutex::new(None)),
            cluster_id: settings.cluster_id,
            in_flight: Arc::new(Semaphore::new(settings.in_flight_max.get())),
            in_flight_max: settings.in_flight_max.get(),
            ledger_id: settings.ledger_id,
            metrics: Arc::new(LedgerMetrics::register(settings.in_flight_max.get())),
            calls_started: Arc::new(std::array::from_fn(|_| AtomicU64::new(0))),
            batching: Arc::new(batch::Batching::new(settings.batch_linger)),
            // On the runtime that made the ledger (the service's main one): a pass sent again
            // from an admin worker's runtime died with it at the stop.
            second_passes: crate::outstanding::Outstanding::here(),
        })
    }

    /// A handle on another ledger of the same cluster, sharing this one's client and bounds.
    pub fn on_ledger(&self, ledger_id: u32) -> Ledger {
        Ledger {
            ledger_id,
            ..self.clone()
        }
    }

    /// The replicas' addresses the client talks to.
    pub fn addresses(&self) -> Vec<SocketAddr> {
        self.client.load().addresses.clone()
    }

    /// Talks to `addresses` from now on (a replica that came back at another address): calls
    /// already in flight finish on the old client, or are given up [`RETIRED_CALLS_GRACE`] after
    /// their callers left; the old client closes once none is left
    /// ([`Ledger::close_replaced_clients`]). Nothing changes if the addresses are the ones in use.
    pub fn reconnect(&self, addresses: &[SocketAddr]) -> Result<bool, ConnectError> {
        let mut retired = lock(&self.retired);
        if self.client.load().addresses == addresses {
            return Ok(false);
        }
        self.replace_client(&mut retired, addresses)?;
        Ok(true)
    }

    /// [`Ledger::connection`] for a call that got its place: `Timeout` if the wait for the place
    /// spent its deadline (a waited call may be handed one as its deadline passes: sent then, it
    /// would be answered `Timeout` all the same while it lands, a release's voids among them).
    fn connection_in_time(
        &self,
        operation: Operation,
        deadline: Instant,
    ) -> Result<Arc<Connection>, LedgerError> {
        if Instant::now() >= deadline {
            return Err(LedgerError::Timeout { operation });
        }
        self.connection(operation)
    }

    /// The connection to call on: the one in use, or, if its client can send nothing more (an
    /// eviction), a new one at the same addresses. The evicted one is retired like a replaced
    /// one, so its calls that will never be answered give their places back.
    ///
    /// At most one new client each [`EVICTED_REPLACE_INTERVAL`]: a cluster that evicts every
    /// client it registers (it serves a later release only, or more instances share it than
    /// it keeps sessions for) made one per call, each with a thread of its own, hundreds a
    /// second. Meanwhile a call fails at once, `client_gone`: one submitted to the evicted
    /// client would never be answered, and keep its place until its deadline.
    fn connection(&self, operation: Operation) -> Result<Arc<Connection>, LedgerError> {
        let connection = self.client.load_full();
        if !connection.is_gone() {
            return Ok(connection);
        }
        let mut retired = lock(&self.retired);
        let current = self.client.load_full();
        if !Arc::ptr_eq(&current, &connection) {
            return Ok(current); // another call replaced it
        }
        let gone = |message: &str| LedgerError::Client {
            operation,
            message: message.to_owned(),
            client_gone: true,
        };
        let mut replaced_at = lock(&self.evicted_replaced_at);
        if replaced_at.is_some_and(|at| at.elapsed() < EVICTED_REPLACE_INTERVAL) {
            return Err(gone(
                "evicted by the cluster; a new client registers within a second",
            ));
        }
        *replaced_at = Some(Instant::now());
        let log = crate::telemetry::log_throttle(&EVICTION_LOGGED_SECOND);
        if log {
            tracing::warn!("the ledger cluster evicted this instance's client (too many clients, or a release it does not serve); a new client registers");
        }
        match self.replace_client(&mut retired, &connection.addresses) {
            Ok(()) => Ok(self.client.load_full()),
            Err(error) => {
                if log {
                    tracing::error!(%error, "could not make a new ledger client; calls fail until one is made");
                }
                Err(gone(
                    "evicted by the cluster, and no new client could be made",
                ))
            }
        }
    }

    /// Swaps in a client for `addresses`, retiring the one in use.
    fn replace_client(
        &self,
        retired: &mut Vec<Arc<Connection>>,
        addresses: &[SocketAddr],
    ) -> Result<(), ConnectError> {
        let connection = Connection::new(self.cluster_id, addresses)?;
        // Those retired before and unused by now: without an address follower (a cluster given
        // by IP literals has none) nothing else would close them, and evictions repeat.
        connection::close_unused(retired);
        let replaced = self.client.swap(Arc::new(connection));
        replaced.retire();
        retired.push(replaced);
        if retired.len() > RETIRED_CLIENTS_MAX
            && crate::telemetry::log_throttle(&RETIRED_LOGGED_SECOND)
        {
            let open = retired.len();
            tracing::warn!(open, "replaced ledger clients are still open: addresses change faster than their calls end");
        }
        Ok(())
    }

    /// Closes the clients [`Ledger::reconnect`] replaced that nothing uses any more; returns how
    /// many are still open. Called at each look at the addresses
    /// ([`addresses::follow_addresses`]), whether or not it succeeds.
    pub fn close_replaced_clients(&self) -> usize {
        let mut retired = lock(&self.retired);
        connection::close_unused(&mut retired);
        retired.len()
    }

    /// Whether `account` is a caller's account of this handle's ledger: not the operator's, nor
    /// another ledger's (a concurrency limit's slots have a caller's kind of id too).
    fn is_callers(&self, account: &tb::Account) -> bool {
        account.ledger() == self.ledger_id && account.code() == model::ACCOUNT_CODE_USER
    }

    /// How many calls this handle (and its clones) started, refused ones included.
    pub fn calls_started(&self) -> u64 {
        Operation::ALL
            .iter()
            .map(|o| self.calls_started_of(*o))
            .sum()
    }

    /// [`Ledger::calls_started`] of one operation: the operator-epoch follower reads the ledger
    /// once a second (`lookup_accounts`), so "no call" of a request is best counted without it.
    pub fn calls_started_of(&self, operation: Operation) -> u64 {
        self.calls_started[operation as usize].load(Ordering::Relaxed)
    }

    /// How many `create_transfers` calls this handle's batches of single transfers made (each
    /// carries one or more requests' transfers).
    pub fn batches_sent(&self) -> u64 {
        self.batching.sent()
    }

    pub fn ledger_id(&self) -> u32 {
        self.ledger_id
    }

    pub fn metrics(&self) -> &LedgerMetrics {
        &self.metrics
    }

    /// Places a hold of `amount` on the account for `timeout_seconds`: one round trip.
    ///
    /// If the caller stops waiting (deadline passed, or the request was dropped) and
    /// `void_if_abandoned` is set, a hold that the ledger did create is voided when its answer
    /// finally arrives, so a request that was refused (fail closed) never keeps credit held.
    pub async fn hold(
        &self,
        account_id: u128,
        amount: u64,
        timeout_seconds: u32,
        deadline: Instant,
        void_if_abandoned: bool,
    ) -> Result<HoldReply, LedgerError> {
        let transfer = model::hold_transfer(account_id, self.ledger_id, amount, timeout_seconds);
        self.place_pending(transfer, deadline, void_if_abandoned)
            .await
    }

    /// Holds what the account has free of a refused `charge` (a balancing debit), for
    /// `timeout_seconds`, but never all of it: a charge that does not fit, counted as far as it
    /// goes (envoyproxy/ratelimit's counter goes past the limit; a ledger account cannot).
    /// `Held` even when nothing was free (a hold of 0). Why at most `charge − 1`: the request
    /// was refused, yet by now the account may have the whole charge free (holds expired since
    /// the ledger said no, or a top-up the local view has not seen); a refused request must not
    /// pay its full price.
    pub async fn hold_what_remains(
        &self,
        account_id: u128,
        charge: u64,
        timeout_seconds: u32,
        deadline: Instant,
    ) -> Result<HoldReply, LedgerError> {
        assert!(charge > 1, "a refused charge of 1 has nothing left to hold");
        let charged = (charge, charge - 1);
        self.over_charge(account_id, charged, timeout_seconds, deadline)
            .await
    }

    /// Holds as much of `charge` as the account has free, all of it when it fits, for
    /// `timeout_seconds`: a refused call's charge on its other descriptors (the Envoy front
    /// end's), counted as far as it goes on each, as envoyproxy/ratelimit adds the hits to every
    /// descriptor. Audited as an over-charge, not as a request admitted. `Held` even when
    /// nothing was free (a hold of 0).
    pub async fn hold_up_to(
        &self,
        account_id: u128,
        charge: u64,
        timeout_seconds: u32,
        deadline: Instant,
    ) -> Result<HoldReply, LedgerError> {
        self.over_charge(account_id, (charge, charge), timeout_seconds, deadline)
            .await
    }

    /// An over-charge of `charge`, holding at most `amount_max` ([`model::over_charge_transfer`]).
    async fn over_charge(
        &self,
        account_id: u128,
        charged: (u64, u64),
        timeout_seconds: u32,
        deadline: Instant,
    ) -> Result<HoldReply, LedgerError> {
        let ledger = self.ledger_id;
        let transfer = model::over_charge_transfer(account_id, ledger, charged, timeout_seconds);
        self.place_pending(transfer, deadline, false).await
    }

    /// Creates one pending debit (a request's hold, a lease, an over-charge) and answers as
    /// [`Ledger::hold`] does, voiding it (with its own code) if it lands after its caller stopped
    /// waiting, given `void_if_abandoned`.
    async fn place_pending(
        &self,
        transfer: tb::Transfer,
        deadline: Instant,
        void_if_abandoned: bool,
    ) -> Result<HoldReply, LedgerError> {
        let (transfer_id, code) = (transfer.id(), transfer.code());
        let void_code = void_if_abandoned.then_some(code);
        self.single_transfer(
            transfer,
            deadline,
            void_code,
            |kind, roundtrip| match kind {
                None => Ok(HoldReply::Held {
                    roundtrip,
                    transfer_id,
                }),
                Some(CreateTransferErrorKind::ExceedsCredits) => Ok(HoldReply::ExceedsCredits),
                Some(CreateTransferErrorKind::DebitAccountNotFound) => {
                    Ok(HoldReply::AccountNotFound)
                }
                Some(CreateTransferErrorKind::DebitAccountAlreadyClosed) => Ok(HoldReply::Blocked),
                Some(kind) => Err(unexpected_transfer("pending: ", kind)),
            },
        )
        .await
    }

    /// One single (not linked) transfer, in the batch this thread is filling (`batch.rs`), under
    /// the in-flight bound and waited for until `deadline`. `answer` reads the ledger's result
    /// (`None`: created) and when it went and came back. The batch's task, not one of the call's
    /// own, keeps the in-flight permit and, given `void_code`, voids a transfer that lands after
    /// its caller stopped waiting.
    async fn single_transfer<T>(
        &self,
        transfer: tb::Transfer,
        deadline: Instant,
        void_code: Option<u16>,
        answer: impl FnOnce(Option<CreateTransferErrorKind>, Roundtrip) -> Result<T, LedgerError>,
    ) -> Result<T, LedgerError> {
        let place = match transfer
            .flags()
            .contains(tb::transfer::Flags::VOID_PENDING_TRANSFER)
        {
            true => Place::Waited,
            false => Place::AtOnce,
        };
        self.single_transfer_placed(transfer, (place, deadline), void_code, answer)
            .await
    }

    /// [`Ledger::single_transfer`], its place under the in-flight bound got as `place` says.
    async fn single_transfer_placed<T>(
        &self,
        transfer: tb::Transfer,
        (place, deadline): (Place, Instant),
        void_code: Option<u16>,
        answer: impl FnOnce(Option<CreateTransferErrorKind>, Roundtrip) -> Result<T, LedgerError>,
    ) -> Result<T, LedgerError> {
        let operation = Operation::CreateTransfers;
        // Not sent with no time left, as in `call`: a hold that landed would be voided again.
        if Instant::now() >= deadline {
            let error = LedgerError::Timeout { operation };
            self.metrics.record_error(error.kind());
            return Err(error);
        }
        let (in_flight, span, started) = self.place(operation, place, deadline).await?;
        let leave = batch::Leave {
            in_flight,
            void_if_abandoned: void_code,
        };
        let connection = match self.connection_in_time(operation, deadline) {
            Ok(connection) => connection,
            Err(error) => return self.finished_early(operation, started, &span, error),
        };
        let created = batch::create_transfer(connection, &self.batching, transfer, leave, deadline)
            .instrument(span.clone())
            .await;
        let result = created.and_then(|(kind, roundtrip)| answer(kind, roundtrip));
        self.finish(operation, started, &span, &result);
        result
    }

    /// Voids a hold, giving its credit back now. `false` if it was no longer pending (expired,
    /// or voided already): nothing to give back.
    pub async fn void(&self, pending_id: u128, deadline: Instant) -> Result<bool, LedgerError> {
        let void = model::void_transfer(pending_id, self.ledger_id);
        self.single_transfer(void, deadline, None, |kind, _| match kind {
            None => Ok(true),
            Some(CreateTransferErrorKind::PendingTransferExpired)
            | Some(CreateTransferErrorKind::PendingTransferAlreadyVoided) => Ok(false),
            Some(kind) => Err(unexpected_transfer("void: ", kind)),
        })
        .await
    }

    /// Creates `accounts`; one that exists already counts as created.
    async fn create_accounts_idempotent(
        &self,
        accounts: Vec<tb::Account>,
        placed: (Place, Instant),
    ) -> Result<(), LedgerError> {
        self.call_placed(
            Operation::CreateAccounts,
            placed,
            move |client| async move {
                match client.create_accounts(accounts).await {
                    Ok(()) => Ok(()),
                    Err(tb::error::CreateAccountsError::Api(errors)) => {
                        for error in errors.as_slice() {
                            match error.kind() {
                                // Differing flags: the account is closed (a block or a move).
                                // Differing user_data_32: its plan's window was edited since
                                // (the id leaves the window out; the account keeps the one it
                                // was made with, for the audit).
                                CreateAccountErrorKind::Exists
                                | CreateAccountErrorKind::ExistsWithDifferentFlags
                                | CreateAccountErrorKind::ExistsWithDifferentUserData32 => {}
                                kind => {
                                    return Err(LedgerError::Unexpected {
                                        operation: Operation::CreateAccounts,
                                        message: format!("{kind:?}"),
                                    })
                                }
                            }
                        }
                        Ok(())
                    }
                    Err(e) => Err(client_error(Operation::CreateAccounts, e)),
                }
            },
            nothing_if_abandoned(),
        )
        .await
    }

    /// Creates the operator and the user account, then the grant: idempotent, so any number of
    /// instances racing on the same new caller credit it exactly once (`exists` counts as success).
    /// The grant goes only after the account exists: a fixed-id transfer that failed once would
    /// answer `id_already_failed` forever.
    pub async fn provision(
        &self,
        account: &UserAccount,
        deadline: Instant,
    ) -> Result<(), LedgerError> {
        let accounts = vec![
            model::operator_account(self.ledger_id),
            model::user_account(account, self.ledger_id),
        ];
        let placed = (Place::AtOnce, deadline);
        self.create_accounts_idempotent(accounts, placed).await?;
        // An id whose grant failed for good (a block or a move landed between the account and
        // its grant: a transient refusal, which TigerBeetle never lets that id retry) moves on
        // to the next; without it, such a caller was never credited, and every request of its
        // failed as unexpected.
        for attempt in 0..model::GRANT_IDS_MAX {
            let grant = model::grant_transfer(account, self.ledger_id, attempt);
            let granted = self
                .single_transfer(grant, deadline, None, |kind, _| match kind {
                    None | Some(CreateTransferErrorKind::Exists) => Ok(true),
                    Some(CreateTransferErrorKind::IdAlreadyFailed) => Ok(false),
                    Some(kind) => Err(unexpected_transfer("grant: ", kind)),
                })
                .await?;
            if granted {
                return Ok(());
            }
        }
        Err(LedgerError::Unexpected {
            operation: Operation::CreateTransfers,
            message: "grant: every grant id failed".to_owned(),
        })
    }

    /// Reads an account's available credit and its live holds (earliest expiry first), to tell a
    /// limited caller exactly when enough credit comes back. Only called on the limited path.
    pub async fn account_view(
        &self,
        account_id: u128,
        window_seconds_max: u32,
        deadline: Instant,
    ) -> Result<Option<AccountView>, LedgerError> {
        let Some(account) = self.lookup_account(account_id, deadline).await? else {
            return Ok(None);
        };
        let (credit, available) = credit_and_available(&account);
        let (holds, complete) = self
            .live_holds(account_id, window_seconds_max, deadline)
            .await?;
        let blocked = if account.flags().contains(tb::account::Flags::CLOSED) {
            Some(self.closed_by(account_id, deadline).await?)
        } else {
            None
        };
        Ok(Some(AccountView {
            credit: u64::try_from(credit).unwrap_or(u64::MAX),
            granted: account.credits_posted() > 0,
            available: u64::try_from(available).unwrap_or(u64::MAX),
            holds,
            complete,
            blocked,
        }))
    }

    /// An account's free credit and whether it is closed, from one lookup: `None` if it does
    /// not exist. Why not [`Ledger::account_view`]: a listing is up to
    /// [`TRANSFERS_PAGES_MAX`] more calls, and a check (Envoy's `hits_addend` 0) needs only this,
    /// unless it is refused.
    pub async fn account_free(
        &self,
        account_id: u128,
        deadline: Instant,
    ) -> Result<Option<AccountFree>, LedgerError> {
        let Some(account) = self.lookup_account(account_id, deadline).await? else {
            return Ok(None);
        };
        let (credit, available) = credit_and_available(&account);
        Ok(Some(AccountFree {
            credit: u64::try_from(credit).unwrap_or(u64::MAX),
            granted: account.credits_posted() > 0,
            available: u64::try_from(available).unwrap_or(u64::MAX),
            closed: account.flags().contains(tb::account::Flags::CLOSED),
        }))
    }

    /// The account's live holds, earliest expiry first ([`Ledger::unresolved_holds`]); `false`
    /// when there were more than it reads. What is left unread is counted as not held, which can
    /// only make the local view refuse less.
    async fn live_holds(
        &self,
        account_id: u128,
        window_seconds_max: u32,
        deadline: Instant,
    ) -> Result<(Vec<Hold>, bool), LedgerError> {
        let (holds, complete) = self
            .unresolved_holds(
                account_id,
                window_seconds_max,
                (Place::AtOnce, deadline),
                live_hold,
            )
            .await?;
        let mut holds: Vec<Hold> = holds.into_iter().map(|(_, hold)| hold).collect();
        holds.sort_by_key(|h| h.expires_at);
        Ok((holds, complete))
    }

    /// The holds `pick` takes from the account's debits of the last `window_seconds_max` (plus
    /// clock slack), less those voided or posted since: newest first, read in at most
    /// [`TRANSFERS_PAGES_MAX`] pages; `false` when there were more than that. Newest first, so
    /// that what a long look-back or a busy account leaves unread is its oldest transfers: the
    /// holds that expire first (often already expired), and never the void of a hold that was
    /// read (a void comes after its hold).
    async fn unresolved_holds<T>(
        &self,
        account_id: u128,
        window_seconds_max: u32,
        placed: (Place, Instant),
        pick: impl Fn(&tb::Transfer, SystemTime) -> Option<(u128, T)>,
    ) -> Result<(Vec<(u128, T)>, bool), LedgerError> {
        // Every live hold was created within the longest a hold lives (the caller's
        // `window_seconds_max`: a window, or a lease's window + L) of now, plus clock slack.
        let now = SystemTime::now();
        // A window of decades (a lifetime quota) reaches before 1970: no minimum then (the
        // client's filter panics on a time before the epoch).
        let timestamp_min = now
            .checked_sub(Duration::from_secs(u64::from(window_seconds_max) + 5))
            .filter(|min| *min > SystemTime::UNIX_EPOCH)
            .unwrap_or(SystemTime::UNIX_EPOCH);
        let mut timestamp_max = None;
        let mut holds = Vec::new();
        // Voided holds (refunds, concurrency slots) still look pending in their own record.
        let mut resolved = std::collections::HashSet::new();
        let mut complete = false;
        for _ in 0..TRANSFERS_PAGES_MAX {
            let newest_first =
                tb::account::FilterFlags::DEBITS | tb::account::FilterFlags::REVERSED;
            let range = (timestamp_min, timestamp_max);
            let page = self
                .transfers_page(account_id, newest_first, range, placed)
                .await?;
            holds.extend(page.iter().filter_map(|transfer| pick(transfer, now)));
            resolved.extend(page.iter().filter_map(resolved_pending));
            match page.last() {
                Some(last) if page.len() == TRANSFERS_PAGE_LIMIT as usize => {
                    timestamp_max = Some(last.timestamp() - Duration::from_nanos(1));
                }
                _ => {
                    complete = true;
                    break;
                }
            }
        }
        holds.retain(|(id, _)| !resolved.contains(id));
        Ok((holds, complete))
    }

    async fn lookup_account(
        &self,
        account_id: u128,
        deadline: Instant,
    ) -> Result<Option<tb::Account>, LedgerError> {
        let accounts = self
            .call(
                Operation::LookupAccounts,
                deadline,
                move |client| async move {
                    client
                        .lookup_accounts(vec![account_id])
                        .await
                        .map_err(|e| client_error(Operation::LookupAccounts, e))
                },
                nothing_if_abandoned(),
            )
            .await?;
        Ok(accounts.first().copied())
    }

    /// Up to [`TRANSFERS_PAGE_LIMIT`] of the account's transfers (`flags`: debits and/or credits)
    /// from `timestamp_min` on, oldest first.
    /// One page of the account's transfers created within `(timestamp_min, timestamp_max)`
    /// (no upper bound when `None`), in the order `flags` asks.
    async fn transfers_page(
        &self,
        account_id: u128,
        flags: tb::account::FilterFlags,
        (timestamp_min, timestamp_max): (SystemTime, Option<SystemTime>),
        placed: (Place, Instant),
    ) -> Result<Vec<tb::Transfer>, LedgerError> {
        let filter = tb::account::Filter::new(account_id, TRANSFERS_PAGE_LIMIT)
            .with_flags(flags)
            .with_timestamp_min(timestamp_min);
        let filter = match timestamp_max {
            Some(timestamp_max) => filter.with_timestamp_max(timestamp_max),
            None => filter,
        };
        self.account_transfers(filter, placed).await
    }

    /// The transfers `filter` selects (one `get_account_transfers` call).
    async fn account_transfers(
        &self,
        filter: tb::account::Filter,
        placed: (Place, Instant),
    ) -> Result<Vec<tb::Transfer>, LedgerError> {
        self.call_placed(
            Operation::GetAccountTransfers,
            placed,
            move |client| async move {
                client
                    .get_account_transfers(Box::new(filter))
                    .await
                    .map_err(|e| client_error(Operation::GetAccountTransfers, e))
            },
            nothing_if_abandoned(),
        )
        .await
    }

    /// One cheap read, to tell whether the ledger answers (for `/readyz`).
    ///
    /// It waits for a place under the in-flight bound: refused at once, a burst of decisions
    /// that filled the bound on a healthy ledger made the instance unready, and an orchestrator
    /// then took it out of service (and its load went to the others).
    pub async fn ping(&self, deadline: Instant) -> Result<(), LedgerError> {
        let operator = model::operator_account_id(self.ledger_id);
        self.call_placed(
            Operation::LookupAccounts,
            (Place::Waited, deadline),
            move |client| async move {
                client
                    .lookup_accounts(vec![operator])
                    .await
                    .map(|_| ())
                    .map_err(|e| client_error(Operation::LookupAccounts, e))
            },
            nothing_if_abandoned(),
        )
        .await
    }

    /// Sets the in-flight gauge to the calls in flight now, and the batches' counter to the calls
    /// they made: call it before rendering the metrics. Why at a scrape and not at each call: a
    /// metric is one more atomic shared by every thread, and changing it per call costs more than
    /// reading the bound's free places (and the batches' own count) here.
    pub fn publish_at_scrape(&self) {
        self.metrics.in_flight_set(self.calls_in_flight());
        self.metrics.batches_set(self.batching.sent());
    }

    /// The in-flight bound: calls at the ledger at once, at most (`ledger.in_flight_max`).
    pub fn in_flight_max(&self) -> usize {
        self.in_flight_max
    }

    /// Calls holding a place under the in-flight bound now: sent, and not answered yet.
    pub fn calls_in_flight(&self) -> usize {
        self.in_flight_max - self.in_flight.available_permits()
    }

    /// A place under the in-flight bound for a call of `operation`, or `Overloaded`.
    fn in_flight(&self, operation: Operation) -> Result<InFlight, LedgerError> {
        self.calls_started[operation as usize].fetch_add(1, Ordering::Relaxed);
        let Ok(permit) = self.in_flight.clone().try_acquire_owned() else {
            let error = LedgerError::Overloaded {
                in_flight_max: self.in_flight_max,
            };
            self.metrics.record_error(error.kind());
            return Err(error);
        };
        Ok(InFlight { permit })
    }

    /// A call's place under the in-flight bound as `place` says, with the call's span and start.
    /// Within an operator's action ([`as_operator_action`]) every call waits for its place.
    async fn place(
        &self,
        operation: Operation,
        place: Place,
        deadline: Instant,
    ) -> Result<(InFlight, tracing::Span, Instant), LedgerError> {
        let operators = OPERATOR_ACTION.try_with(|_| ()).is_ok();
        let place = if operators { Place::Waited } else { place };
        match place {
            Place::AtOnce => self.place_at_once(operation),
            // Boxed: only a give-back waits, and the wait's state would weigh on every call's
            // future (a hold's included) as a timer and a semaphore's acquire.
            Place::Waited => Box::pin(self.place_waited(operation, deadline)).await,
        }
    }

    /// A call's place under the in-flight bound at once, with the call's span and start, or
    /// `Overloaded` (counted by [`Ledger::in_flight`]).
    fn place_at_once(
        &self,
        operation: Operation,
    ) -> Result<(InFlight, tracing::Span, Instant), LedgerError> {
        let in_flight = self.in_flight(operation)?;
        Ok((in_flight, call_span(operation), Instant::now()))
    }

    /// A call's place under the in-flight bound, waited for until `deadline` ([`Place::Waited`]).
    /// The wait is part of the call, in its span and its duration: one that reaches the deadline
    /// is the call's failure, `Overloaded`, counted as a call failed at its deadline.
    async fn place_waited(
        &self,
        operation: Operation,
        deadline: Instant,
    ) -> Result<(InFlight, tracing::Span, Instant), LedgerError> {
        let (span, started) = (call_span(operation), Instant::now());
        self.calls_started[operation as usize].fetch_add(1, Ordering::Relaxed);
        let permit = self.in_flight.clone().acquire_owned();
        match tokio::time::timeout_at(deadline.into(), permit).await {
            Ok(Ok(permit)) => Ok((InFlight { permit }, span, started)),
            // Timed out, or the bound closed (it never is).
            Ok(Err(_)) | Err(_) => {
                let error = LedgerError::Overloaded {
                    in_flight_max: self.in_flight_max,
                };
                self.finished_early(operation, started, &span, error)
            }
        }
    }

    /// A call that ended before it was sent, with `error`: counted as any other.
    fn finished_early<T>(
        &self,
        operation: Operation,
        started: Instant,
        span: &tracing::Span,
        error: LedgerError,
    ) -> Result<T, LedgerError> {
        let result = Err(error);
        self.finish(operation, started, span, &result);
        result
    }

    /// Counts a finished call (its duration as its caller waited, and its error's kind) and
    /// names its outcome on its span.
    fn finish<T>(
        &self,
        operation: Operation,
        started: Instant,
        span: &tracing::Span,
        result: &Result<T, LedgerError>,
    ) {
        let status = if result.is_ok() {
            CallStatus::Ok
        } else {
            CallStatus::Error
        };
        let seconds = started.elapsed().as_secs_f64();
        self.metrics.record_call(operation, status, seconds);
        span.record("ledger.outcome", status.as_str());
        if let Err(error) = result {
            self.metrics.record_error(error.kind());
            // An error span for every failed call (a refusal the ledger answers is no error).
            span.record("otel.status_code", "ERROR");
            span.record("otel.status_description", tracing::field::display(error));
        }
    }

    /// [`Ledger::call_placed`], refused `Overloaded` at once when the bound is full.
    async fn call<T, F, Fut, A>(
        &self,
        operation: Operation,
        deadline: Instant,
        make: F,
        on_abandoned: Option<A>,
    ) -> Result<T, LedgerError>
    where
        T: Send + 'static,
        F: FnOnce(Arc<tb::Client>) -> Fut,
        Fut: Future<Output = Result<T, LedgerError>> + Send + 'static,
        A: FnOnce(Arc<Connection>, &Result<T, LedgerError>) + Clone + Send + 'static,
    {
        let placed = (Place::AtOnce, deadline);
        self.call_placed(operation, placed, make, on_abandoned)
            .await
    }

    /// Runs one ledger call in its own task under the in-flight bound (its place got as `place`
    /// says), and waits for it until `deadline`. `on_abandoned` sees the result if it arrives
    /// after the caller stopped waiting (unless the call was given up on a replaced client:
    /// `connection.rs`). Every failure is counted by kind.
    async fn call_placed<T, F, Fut, A>(
        &self,
        operation: Operation,
        (place, deadline): (Place, Instant),
        make: F,
        on_abandoned: Option<A>,
    ) -> Result<T, LedgerError>
    where
        T: Send + 'static,
        F: FnOnce(Arc<tb::Client>) -> Fut,
        Fut: Future<Output = Result<T, LedgerError>> + Send + 'static,
        A: FnOnce(Arc<Connection>, &Result<T, LedgerError>) + Clone + Send + 'static,
    {
        // A call with no time left is not sent: nobody would wait for its answer, and under the
        // closed policy a hold that landed would cost a second write to void it.
        if Instant::now() >= deadline {
            let error = LedgerError::Timeout { operation };
            self.metrics.record_error(error.kind());
            return Err(error);
        }
        let (in_flight, span, started) = self.place(operation, place, deadline).await?;
        let connection = match self.connection_in_time(operation, deadline) {
            Ok(connection) => connection,
            Err(error) => return self.finished_early(operation, started, &span, error),
        };
        let (sender, receiver) = oneshot::channel();
        let future = make(connection.client.clone());
        let late = (on_abandoned.clone()).map(|late| (late, connection.clone()));
        let mut answer = CallAnswer { receiver, late };
        tokio::spawn(
            async move {
                let connection = &connection;
                let future = async move {
                    let answer = future.await;
                    if answer.as_ref().is_err_and(LedgerError::is_client_gone) {
                        connection.mark_gone();
                    }
                    answer
                };
                let answered = answer_or_leave(future, sender, connection, in_flight).await;
                if let (Some(Err(result)), Some(on_abandoned)) = (answered, on_abandoned) {
                    on_abandoned(connection.clone(), &result);
                }
            }
            .instrument(span.clone()),
        );
        let receiver = &mut answer.receiver;
        let result = match tokio::time::timeout_at(deadline.into(), &mut *receiver).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(LedgerError::Unexpected {
                operation,
                message: "the ledger task ended without an answer".to_owned(),
            }),
            // Closed first, then read: an answer sent as the deadline passed is used, and one
            // sent after goes to `on_abandoned` (its send fails). Dropping the receiver instead
            // lost an answer sent in between: its hold was neither used nor voided.
            Err(_) => {
                receiver.close();
                receiver
                    .try_recv()
                    .unwrap_or(Err(LedgerError::Timeout { operation }))
            }
        };
        self.finish(operation, started, &span, &result);
        result
    }
}

/// The caller's end of a [`Ledger::call`], or of a transfer in a batch (`batch.rs`). The
/// call's task hands an answer to `on_abandoned` when its send fails (the caller had left); one
/// whose request went away just after the send succeeded, before reading it, is taken back here
/// when dropped, and handed over the same way.
struct CallAnswer<T, A>
where
    A: FnOnce(Arc<Connection>, &Result<T, LedgerError>),
{
    receiver: oneshot::Receiver<Result<T, LedgerError>>,
    late: Option<(A, Arc<Connection>)>,
}

impl<T, A> Drop for CallAnswer<T, A>
where
    A: FnOnce(Arc<Connection>, &Result<T, LedgerError>),
{
    fn drop(&mut self) {
        let Some((late, connection)) = self.late.take() else {
            return;
        };
        // After a read, a no-op and an error; before one, the answer that was sent, if any.
        self.receiver.close();
        if let Ok(result) = self.receiver.try_recv() {
            late(connection, &result);
        }
    }
}

/// What [`Ledger::call`] does with an answer that came after its caller left.
type OnAbandoned<T> = fn(Arc<Connection>, &Result<T, LedgerError>);

/// For [`Ledger::call`]: nothing to do with an answer that came after its caller left.
fn nothing_if_abandoned<T>() -> Option<OnAbandoned<T>> {
    None
}

/// Waits for `call`'s answer and sends it to the caller. Returns the answer back if the caller
/// had left by then, and `None` if the call was given up on its replaced connection.
async fn answer_or_leave<T, F: Future<Output = T>>(
    call: F,
    mut sender: oneshot::Sender<T>,
    connection: &Connection,
    in_flight: InFlight,
) -> Option<Result<(), T>> {
    tokio::pin!(call);
    let answer = tokio::select! {
        biased;
        answer = &mut call => answer,
        () = sender.closed() => connection.unless_given_up(&mut call).await?,
    };
    // The ledger answered (or the call was given up, above): the place goes back before the
    // answer does, as a batch's does. After it, a caller's next call (a provisioning's grant
    // after its accounts) could find its own last place still taken, and fail `Overloaded`.
    drop(in_flight);
    Some(sender.send(answer))
}

/// How a call gets its place under the in-flight bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Place {
    /// At once, or `Overloaded`: a decision fails fast rather than queue behind a burst.
    AtOnce,
    /// Waited for until the call's deadline: a give-back (a void, a release by amount, a
    /// recharge), which refused at once was lost, its units held for the rest of their timeout
    /// (a concurrency slot for a minute, its caller refused "too many in flight" with none);
    /// and an operator's action, whose moment to act is often a flood that fills the bound.
    Waited,
}

/// A call's place under the in-flight bound; it ends when dropped, once the ledger has answered.
/// Places merged into one ([`InFlight::merge`]) end together.
pub struct InFlight {
    permit: tokio::sync::OwnedSemaphorePermit,
}

impl InFlight {
    /// Makes `other`'s place this one's: both end when this is dropped. Why: a batch gives its
    /// members' places back at once, and each release of a semaphore's permits takes its
    /// waiters' lock: once per batch, not once per transfer.
    pub fn merge(&mut self, other: InFlight) {
        // Panics for places under two bounds: one batch is for one client.
        self.permit.merge(other.permit);
    }

    /// Calls this place stands for.
    pub fn calls(&self) -> usize {
        self.permit.num_permits()
    }

    /// Takes `calls` of this place's calls into a place of their own.
    pub fn split(&mut self, calls: usize) -> InFlight {
        assert!(calls <= self.calls());
        let permit = self.permit.split(calls).expect("checked above");
        InFlight { permit }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cluster that evicts every client it registers made a new client (a thread each) per
    /// call. One a second at most; meanwhile calls fail at once, the client gone.
    #[tokio::test]
    async fn an_evicted_client_is_replaced_at_most_once_a_second() {
        let settings = LedgerSettings {
            cluster_id: 0,
            // Nothing answers there; the client connects lazily.
            addresses: vec!["127.0.0.1:1".parse().unwrap()],
            ledger_id: model::LEDGER_REQUEST_RATE,
            in_flight_max: NonZeroUsize::new(8).unwrap(),
            batch_linger: Duration::ZERO,
        };
        let ledger = Ledger::connect(&settings).unwrap();
        let first = ledger.client.load_full();
        let operation = Operation::CreateTransfers;
        let mut clients = vec![first];
        for _ in 0..50 {
            ledger.client.load().mark_gone();
            match ledger.connection(operation) {
                Ok(connection) => clients.push(connection),
                Err(error) => assert!(matches!(
                    error,
                    LedgerError::Client {
                        client_gone: true,
                        ..
                    }
                )),
            }
        }
        clients.dedup_by(|a, b| Arc::ptr_eq(a, b));
        assert_eq!(clients.len(), 2, "one new client within the second");
        assert_eq!(lock(&ledger.retired).len(), 1);
    }
}
