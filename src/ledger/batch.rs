//! Single transfers sent together: the requests one thread has ready at once share one
//! `create_transfers` call.
//!
//! Why: the TigerBeetle client runs its own I/O thread. Each call is a submit to that thread and a
//! completion that wakes the caller's thread, two cross-thread wake-ups (and their context
//! switches) per request. They, not the ledger, made most of an admitted request's CPU. The
//! client already packs concurrent calls into one request to the cluster; this packs them
//! before they cross threads, so a batch of n holds costs two wake-ups instead of 2n.
//!
//! How: the first transfer a thread sends opens a batch and spawns one task for it. That task
//! yields once (every request this thread has ready joins meanwhile), sends the batch and hands
//! each transfer its own result. With a linger (`ledger.batch_linger_ms`, opt-in) the task waits
//! that long instead (at most half its first member's time left; a member due sooner than the
//! batch goes opens its own), so that requests arriving apart
//! share a call too: at low rates, where each request would otherwise wake the client's thread
//! on its own, that trades the linger's latency for fewer wake-ups (BENCHMARKS.md, run AA). A
//! batch that fills meanwhile still waits its linger out (the next request opens another): at
//! most 5 ms, against 128 transfers that take far longer to gather at the rates a linger is for.
//! Results are per event, as TigerBeetle gives them: a batch is n independent transfers, never a
//! linked chain (those keep their own calls). Bounded: [`BATCH_TRANSFERS_MAX`] transfers per call.
//!
//! The batch's task, not the request, owns what must outlive a request that stops waiting: its
//! members' in-flight permits (merged, given back at once when the ledger answers) and, for a
//! hold, the void that gives its credit back if it lands after its caller left. It also keeps
//! its members' deadlines: it answers each one `Timeout` at its own deadline, then goes on
//! waiting for the ledger. So a request waits on a channel only: one task and one timer per
//! batch, not one of each per request (a timer is a lock of the runtime's timer wheel to set it
//! and another to clear it).

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tb::error::CreateTransferErrorKind;
use tigerbeetle_unofficial as tb;
use tokio::sync::oneshot;

use super::metrics::Operation;
use super::{client_error, model, Connection, InFlight, LedgerError, Roundtrip};
use crate::sync::lock;

/// Transfers per call: well under a development-mode cluster's 32 KiB request (about 255).
pub const BATCH_TRANSFERS_MAX: usize = 128;

/// The longest `ledger.batch_linger_ms`: every decision that opens a batch waits it out, and
/// past a few milliseconds the latency costs more than the wake-ups it saves.
pub const BATCH_LINGER_MAX: Duration = Duration::from_millis(5);

/// How one ledger's batches go: how long they wait for more, and how many calls they made.
pub struct Batching {
    linger: Duration,
    /// One atomic per batch, shared by every thread; published as a metric at each scrape
    /// ([`super::Ledger::publish_at_scrape`]), not counted twice here.
    sent: AtomicU64,
}

impl Batching {
    pub fn new(linger: Duration) -> Self {
        assert!(
            linger <= BATCH_LINGER_MAX,
            "Ledger::connect refuses a longer one"
        );
        Batching {
            linger,
            sent: AtomicU64::new(0),
        }
    }

    /// Calls made so far (counted as their batches open: each one opened is sent).
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    fn count_sent(&self) {
        self.sent.fetch_add(1, Ordering::Relaxed);
    }
}

/// One transfer's result: `None` when created; and when its batch went and its answer was read,
/// both in the batch's task ([`Roundtrip`]: the local view counts a hold a listing counts once).
pub type TransferResult = Result<(Option<CreateTransferErrorKind>, Roundtrip), LedgerError>;

struct Batch {
    /// Taken when sent: a thread's `FILLING` may keep a sent batch until that thread opens
    /// another (its task may have run on another thread), and must not keep a replaced client
    /// open meanwhile (`connection.rs`).
    connection: Option<Arc<Connection>>,
    transfers: Vec<tb::Transfer>,
    members: Vec<Member>,
    /// Every member's place under the in-flight bound, merged: held until the ledger answers
    /// (the bound counts calls at the ledger, not callers still waiting). Taken with the rest
    /// when sent.
    in_flight: Option<InFlight>,
    /// Taken to be sent: nothing may join any more.
    sent: bool,
    /// When a lingering batch goes (`None`: after one yield). A transfer whose deadline is
    /// sooner opens a batch of its own: joined, it would be answered `Timeout` late, and sent
    /// for nothing.
    sends_at: Option<Instant>,
}

/// One transfer's caller, as the batch sees it.
struct Member {
    /// `None` once answered `Timeout`: its caller stopped waiting.
    reply: Option<oneshot::Sender<TransferResult>>,
    deadline: Instant,
    /// A hold created after its caller stopped waiting is voided with this code.
    void_if_abandoned: Option<u16>,
}

/// What a transfer's caller leaves with the batch (`create_transfer`).
pub struct Leave {
    pub in_flight: InFlight,
    pub void_if_abandoned: Option<u16>,
}

thread_local! {
    /// The batch this thread is filling (the task its first transfer spawned sends it after one
    /// yield).
    static FILLING: RefCell<Option<Arc<Mutex<Batch>>>> = const { RefCell::new(None) };
}

/// Creates `transfer` (not linked) in the batch this thread is filling; the result is its own,
/// answered by `deadline` at the latest (`Timeout` then). What `leave` holds stays with the
/// batch until the ledger answers.
pub(super) async fn create_transfer(
    connection: Arc<Connection>,
    batching: &Batching,
    transfer: tb::Transfer,
    leave: Leave,
    deadline: Instant,
) -> TransferResult {
    assert!(
        !transfer.flags().contains(tb::transfer::Flags::LINKED),
        "a linked chain is not a batch of independent transfers"
    );
    let (reply, receiver) = oneshot::channel();
    let member = Member {
        reply: Some(reply),
        deadline,
        void_if_abandoned: leave.void_if_abandoned,
    };
    // A member whose request went away just after the batch's send to it succeeded, before
    // reading it, would keep its hold for a whole timeout (the batch voids only the holds whose
    // sends failed): dropped unread, its end takes the answer back and voids what it created.
    let (id, ledger) = (transfer.id(), transfer.ledger());
    let late = (leave.void_if_abandoned).map(|code| {
        let void = move |connection: Arc<Connection>, result: &TransferResult| {
            if let Ok((None, _)) = result {
                let voids = vec![model::void_transfer(id, ledger).with_code(code)];
                connection.void_abandoned_later(voids);
            }
        };
        (void, connection.clone())
    });
    // At most half the time left: a batch that lingered to its first member's deadline would
    // be sent to be answered `Timeout`.
    let linger_until = (!batching.linger.is_zero()).then(|| {
        let now = Instant::now();
        now + batching
            .linger
            .min(deadline.saturating_duration_since(now) / 2)
    });
    let opened = join_or_open(&connection, transfer, member, leave.in_flight, linger_until);
    let mut answer = super::CallAnswer { receiver, late };
    if let Some(opened) = opened {
        // Counted here, not in the task: every batch opened is sent, and the task then needs no
        // handle on the count (an Arc's two shared writes per batch).
        batching.count_sent();
        tokio::spawn(async move {
            match linger_until {
                // Every request this thread has ready gets to join before the batch goes.
                None => tokio::task::yield_now().await,
                // And every one that comes within the linger.
                Some(until) => tokio::time::sleep_until(until.into()).await,
            }
            send(&opened).await;
        });
    }
    // The batch answers by the deadline: its task keeps the timer.
    (&mut answer.receiver).await.unwrap_or_else(|_| {
        Err(LedgerError::Unexpected {
            operation: Operation::CreateTransfers,
            message: "a batch ended without an answer".to_owned(),
        })
    })
}

/// Joins this thread's open batch when it is for the same client, has room and goes no later
/// than `sends_at`, when the member would go on its own; else opens one that goes then
/// (returned: the caller has it sent).
fn join_or_open(
    connection: &Arc<Connection>,
    transfer: tb::Transfer,
    member: Member,
    in_flight: InFlight,
    sends_at: Option<Instant>,
) -> Option<Arc<Mutex<Batch>>> {
    FILLING.with(|filling| {
        let mut filling = filling.borrow_mut();
        if let Some(open) = filling.as_ref() {
            let mut batch = lock(open);
            let fits = !batch.sent && batch.transfers.len() < BATCH_TRANSFERS_MAX;
            // No later than it would go on its own (half its time left, at most).
            let in_time = batch.sends_at.is_none_or(|at| at <= sends_at.unwrap_or(at));
            let same = |open: &Arc<Connection>| Arc::ptr_eq(open, connection);
            if fits && in_time && batch.connection.as_ref().is_some_and(same) {
                batch.transfers.push(transfer);
                batch.members.push(member);
                let merged = batch
                    .in_flight
                    .as_mut()
                    .expect("an open batch holds its places");
                merged.merge(in_flight);
                return None;
            }
        }
        let opened = Arc::new(Mutex::new(Batch {
            connection: Some(connection.clone()),
            transfers: vec![transfer],
            members: vec![member],
            in_flight: Some(in_flight),
            sent: false,
            sends_at,
        }));
        *filling = Some(opened.clone());
        Some(opened)
    })
}

/// Sends the batch (closed to newcomers first), answers each member `Timeout` at its deadline
/// while the ledger has not answered, then each its own result; voids the holds that landed after
/// their callers left. A batch whose callers all left is given up if its client was replaced and
/// still does not answer (`connection.rs`).
async fn send(opened: &Arc<Mutex<Batch>>) {
    let (connection, transfers, mut members, in_flight) = close(opened);
    let count = transfers.len();
    let ids: Vec<(u128, u32)> = transfers.iter().map(|t| (t.id(), t.ledger())).collect();
    let sent_at = Instant::now();
    let answer = {
        let call = connection.client.create_transfers(transfers);
        tokio::pin!(call);
        loop {
            let Some(next) = members
                .iter()
                .filter(|m| m.reply.is_some())
                .map(|m| m.deadline)
                .min()
            else {
                // Every caller left: wait for the ledger alone.
                break connection.unless_given_up(&mut call).await;
            };
            tokio::select! {
                answer = &mut call => break Some(answer),
                () = tokio::time::sleep_until(next.into()) => time_out(&mut members),
            }
        }
    };
    // The ledger has answered, or the batch was given up: the places go back before the answers
    // do, but for those of the holds voided below (their callers left), taken until the voids
    // are answered: the bound counts that work too.
    let mut in_flight = in_flight;
    let voiding = answer
        .is_some()
        .then(|| in_flight.split(abandoned(&members)));
    drop(in_flight);
    let Some(answer) = answer else {
        return; // its outcome is unknown: its holds, if placed, expire on their own
    };
    if let Err(error) = &answer {
        if super::connection::is_client_gone(error) {
            connection.mark_gone();
        }
    }
    let mut voids = Vec::new();
    let roundtrip = Roundtrip {
        sent_at,
        answered_at: Instant::now(),
    };
    let answered = members
        .into_iter()
        .zip(results(answer, count, roundtrip))
        .zip(ids);
    for ((member, result), (id, ledger_id)) in answered {
        let created = matches!(result, Ok((None, _)));
        let left = member.reply.is_none_or(|reply| reply.send(result).is_err());
        if let (true, true, Some(code)) = (left, created, member.void_if_abandoned) {
            voids.push(model::void_transfer(id, ledger_id).with_code(code));
        }
    }
    if !voids.is_empty() {
        connection.void_abandoned(voids).await;
    }
    drop(voiding);
}

/// How many members' holds are voided if created: their callers left (answered `Timeout`, or
/// gone since). One that leaves after this count is voided without a place of its own.
fn abandoned(members: &[Member]) -> usize {
    let left = |m: &&Member| m.reply.as_ref().is_none_or(oneshot::Sender::is_closed);
    let voided = members.iter().filter(|m| m.void_if_abandoned.is_some());
    voided.filter(left).count()
}

/// Closes the batch to newcomers and takes what it holds.
fn close(
    opened: &Arc<Mutex<Batch>>,
) -> (Arc<Connection>, Vec<tb::Transfer>, Vec<Member>, InFlight) {
    let mut batch = lock(opened);
    assert!(!batch.sent);
    batch.sent = true;
    let transfers = std::mem::take(&mut batch.transfers);
    let members = std::mem::take(&mut batch.members);
    assert_eq!(transfers.len(), members.len());
    let in_flight = batch
        .in_flight
        .take()
        .expect("an open batch holds its places");
    assert_eq!(in_flight.calls(), members.len(), "a place per member");
    // Whichever thread this task runs on, its own open batch is another one: leave it.
    FILLING.with(|filling| {
        let mut filling = filling.borrow_mut();
        if filling
            .as_ref()
            .is_some_and(|open| Arc::ptr_eq(open, opened))
        {
            *filling = None;
        }
    });
    let connection = batch
        .connection
        .take()
        .expect("an open batch has its connection");
    (connection, transfers, members, in_flight)
}

/// Answers `Timeout` to every member whose deadline has come.
fn time_out(members: &mut [Member]) {
    let now = Instant::now();
    for member in members.iter_mut().filter(|m| m.deadline <= now) {
        if let Some(reply) = member.reply.take() {
            let operation = Operation::CreateTransfers;
            let _ = reply.send(Err(LedgerError::Timeout { operation }));
        }
    }
}

/// Each transfer's result from the call's.
fn results(
    answer: Result<(), tb::error::CreateTransfersError>,
    count: usize,
    roundtrip: Roundtrip,
) -> Vec<TransferResult> {
    match answer {
        Ok(()) => vec![Ok((None, roundtrip)); count],
        Err(tb::error::CreateTransfersError::Api(errors)) => {
            let mut kinds: Vec<TransferResult> = vec![Ok((None, roundtrip)); count];
            for error in errors.as_slice() {
                // An index outside the batch would be the client's bug: that transfer's caller
                // gets no kind, the others theirs.
                if let Some(kind) = kinds.get_mut(error.index() as usize) {
                    *kind = Ok((Some(error.kind()), roundtrip));
                }
            }
            kinds
        }
        Err(error) => {
            let error = client_error(Operation::CreateTransfers, error);
            vec![Err(error); count]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(reply: Option<oneshot::Sender<TransferResult>>, void: Option<u16>) -> Member {
        Member {
            reply,
            deadline: Instant::now(),
            void_if_abandoned: void,
        }
    }

    /// The places kept for the voids are those of members whose callers left (timed out, or gone
    /// since) and whose holds are voided if created; no more, no fewer.
    #[test]
    fn the_places_kept_for_voids_are_the_abandoned_holds() {
        let (waiting, _kept) = oneshot::channel();
        let (gone, dropped) = oneshot::channel();
        drop(dropped);
        let (unvoided, _kept_too) = oneshot::channel();
        let members = [
            member(None, Some(9)),          // timed out
            member(Some(gone), Some(9)),    // gone since
            member(Some(waiting), Some(9)), // still waiting
            member(None, None),             // timed out, but not voided (an operator's)
            member(Some(unvoided), None),
        ];
        assert_eq!(abandoned(&members), 2);
    }
}
